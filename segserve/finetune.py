"""Fine-tune a causal LM on annotated samples so that it emits the segment markers itself.

In: an annotation directory (`segserve segments annotate`: samples.jsonl and the tokenizer with the marker
tokens) and a model directory. Out: a merged transformers checkpoint (weights with the embeddings resized to
the tokenizer, the tokenizer with its recorded markers, generation config) that `segserve serve --model DIR`
serves, and OUT/finetune.json with the loss curve.

LoRA (peft) on every linear layer of the decoder, plus the embedding rows of the marker tokens (peft's
trainable tokens), merged into the weights at the end; or, with `is_full`, every weight. A plain torch loop:
the loss is the next-token cross-entropy on the label tokens only (the completion, or the last assistant
turn).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from segserve.annotate import MARKERS_KEY, SAMPLES_FILE, TOKENIZER_DIR

IGNORE = -100


@dataclass(frozen=True)
class FinetuneConfig:
    """Training settings of `segserve finetune`."""

    num_epochs: int = 2
    """Passes over the samples."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run every epoch)."""
    batch_size: int = 8
    """Samples per optimizer step."""
    learning_rate: float = 1e-3
    """AdamW learning rate (linear warm-up over the first tenth of the steps, then linear decay); ~1e-5 with full."""
    is_full: bool = False
    """Train every weight instead of LoRA adapters plus the marker embeddings."""
    lora_rank: int = 8
    """Rank of the LoRA adapters."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    max_length: int = 256
    """Longer samples are cut to this many tokens."""
    seed: int = 0
    """Seed of the sample order and the adapters' initialization."""

    def __post_init__(self) -> None:
        if self.num_epochs <= 0 or self.batch_size <= 0 or self.max_steps < 0 or self.max_length < 2:
            raise ValueError("num_epochs and batch_size must be > 0, max_steps >= 0, max_length >= 2")
        if self.learning_rate <= 0 or self.lora_rank <= 0 or self.lora_alpha <= 0:
            raise ValueError("learning_rate, lora_rank and lora_alpha must be > 0")


def encode_sample(sample: dict, tokenizer: Any, max_length: int) -> tuple[list[int], int]:
    """(token ids, number of prompt tokens): the label is everything after the prompt."""
    if isinstance(sample.get("messages"), list):
        messages = sample["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("a chat sample must end with the assistant message it teaches")
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render the conversation as prompt + reply")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        label_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
    else:
        prompt_ids = prompt_token_ids(sample["prompt"], tokenizer)
        label_ids = tokenizer.encode(sample["completion"], add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = (prompt_ids + label_ids)[:max_length]
    if len(prompt_ids) >= len(ids):
        raise ValueError(f"a sample's prompt fills max_length ({max_length}): no label tokens are left")
    return ids, len(prompt_ids)


def prompt_token_ids(prompt: str, tokenizer: Any) -> list[int]:
    """A completion prompt as the served model sees it: BOS (when the tokenizer has one) + the text."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(prompt, add_special_tokens=False)


def load_model_for_tokenizer(model_dir: str | Path, tokenizer: Any):
    """The fp32 model with its embeddings grown to the tokenizer (new rows at the mean of the old ones)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return model


def marker_token_ids(tokenizer: Any) -> list[int]:
    """The ids of the markers recorded in the tokenizer (each must be one token)."""
    markers = tokenizer.init_kwargs.get(MARKERS_KEY) or []
    ids = [tokenizer.convert_tokens_to_ids(m) for m in markers]
    if not markers or any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"the tokenizer records no {MARKERS_KEY} that are single tokens: annotate the samples first")
    return ids


def _with_adapters(model: Any, config: FinetuneConfig, marker_ids: list[int]):
    from peft import LoraConfig, get_peft_model

    trainable = {"embed_tokens": marker_ids}
    if not model.config.get_text_config().tie_word_embeddings:
        trainable["lm_head"] = marker_ids  # an untied head needs the markers' output rows too
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules="all-linear",
                      trainable_token_indices=trainable, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _batch_loss(model: Any, batch: list[tuple[list[int], int]], pad_id: int):
    """Mean cross-entropy over the label tokens of `batch`. Rows are left-padded, so every label span ends
    at the last column and logits are computed only over the last columns (the vocabulary projection
    dominates the cost)."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    num_kept = max(len(ids) - num_prompt for ids, num_prompt in batch) + 1
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T], left-padded
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.full((len(batch), width), IGNORE, dtype=torch.long)  # targets[b, t] = token t + 1
    for row, (ids, num_prompt) in enumerate(batch):
        offset = width - len(ids)
        input_ids[row, offset:] = torch.tensor(ids)
        attention[row, offset:] = 1
        targets[row, offset + num_prompt - 1: width - 1] = torch.tensor(ids[num_prompt:])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, T]: pads do not shift the tokens' positions
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                   logits_to_keep=num_kept).logits  # [B, K, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets[:, -num_kept:].flatten(),
                                             ignore_index=IGNORE)


def _batches(samples: list, batch_size: int, rng: random.Random) -> list[list]:
    """One epoch's batches: shuffled, then sorted by length within groups of 8 batches (less padding)."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    group = 8 * batch_size
    batches = []
    for begin in range(0, len(order), group):
        chunk = sorted(order[begin: begin + group], key=lambda i: len(samples[i][0]))
        batches += [[samples[i] for i in chunk[b: b + batch_size]] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _train(model: Any, samples: list[tuple[list[int], int]], config: FinetuneConfig, num_steps: int,
           pad_id: int) -> list[float]:
    """AdamW with linear warm-up (the first tenth of the steps) and linear decay; returns each step's loss."""
    import torch
    from tqdm import tqdm

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    warmup = max(1, num_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (num_steps - s) / max(1, num_steps - warmup))))
    rng, losses = random.Random(config.seed), []
    progress = tqdm(total=num_steps, desc="finetune", unit="step")
    while len(losses) < num_steps:
        for batch in _batches(samples, config.batch_size, rng):
            if len(losses) == num_steps:
                break
            loss = _batch_loss(model, batch, pad_id)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            progress.update()
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    progress.close()
    return losses


def finetune(data_dir: str | Path, model_dir: str | Path, out_dir: str | Path, config: FinetuneConfig) -> dict:
    """Train, merge, save to `out_dir`; returns (and writes to OUT/finetune.json) the run's summary."""
    import torch
    from transformers import AutoTokenizer

    data, out = Path(data_dir), Path(out_dir)
    if not (data / SAMPLES_FILE).is_file() or not (data / TOKENIZER_DIR).is_dir():
        raise FileNotFoundError(f"{data} is not an annotation directory (`segserve segments annotate --out`)")
    tokenizer = AutoTokenizer.from_pretrained(str(data / TOKENIZER_DIR))
    marker_ids = marker_token_ids(tokenizer)
    with open(data / SAMPLES_FILE, encoding="utf-8") as f:
        samples = [encode_sample(json.loads(line), tokenizer, config.max_length) for line in f if line.strip()]
    if not samples:
        raise ValueError(f"{data / SAMPLES_FILE} holds no samples")
    torch.manual_seed(config.seed)
    model = load_model_for_tokenizer(model_dir, tokenizer)
    if not config.is_full:
        model = _with_adapters(model, config, marker_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    num_steps = math.ceil(len(samples) / config.batch_size) * config.num_epochs
    num_steps = min(num_steps, config.max_steps) if config.max_steps else num_steps
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses = _train(model, samples, config, num_steps, pad_id)
    model.eval()
    if not config.is_full:
        model = model.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    window = max(1, min(5, len(losses) // 4))
    summary = {"model": str(model_dir), "data": str(data), "out": str(out), "num_samples": len(samples),
               "num_steps": len(losses), "num_trainable_params": num_trainable,
               "first_loss": sum(losses[:window]) / window, "last_loss": sum(losses[-window:]) / window,
               "losses": losses, "markers": tokenizer.init_kwargs[MARKERS_KEY], "config": asdict(config)}
    (out / "finetune.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
