"""Linears with their rows handed over by a RowPolicy compute what nn.Linear computes; in fixed blocks a row's
output does not depend on the rest of the batch (on the test device, with torch's linear and, on a CPU, the
packed oneDNN one); the probe picks the cheapest policy that holds, and the runner applies it."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from tests.support.devices import TEST_DEVICE
from tests.support.exact import assert_linear_within_rounding
from worker.config import WorkerConfig
from worker import packed_linear
from worker.packed_linear import PackedLinear, choose_row_policies, is_packing_supported
from worker.row_blocks import (
    PROBE_COUNTS,
    RowBlockLinear,
    RowPolicy,
    block_rows_for,
    choose_policy,
    in_row_blocks,
    varies_with_rows,
)

HAS_PACKING = is_packing_supported(torch.device("cpu"), torch.float32)
POLICIES = [RowPolicy(), RowPolicy(min_rows=8), RowPolicy(block_rows=8)]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 7, 8, 9, 20])
def test_matches_linear(num_rows, bias, policy):
    torch.manual_seed(0)
    linear = nn.Linear(48, 100, bias=bias).to(TEST_DEVICE)
    x = torch.randn(1, num_rows, 48).to(TEST_DEVICE)  # [B, M, K] as a causal LM hands it over
    with torch.inference_mode():
        out = RowBlockLinear(linear, policy)(x)
        assert out.shape == (1, num_rows, 100)
        assert_linear_within_rounding(out, x, linear.weight, linear.bias)


def blocked_layers() -> list:
    torch.manual_seed(0)
    linear = nn.Linear(640, 4096, bias=False).to(TEST_DEVICE)
    policy = RowPolicy(block_rows=block_rows_for(linear.weight.device))
    layers = [("torch", RowBlockLinear(linear, policy))]
    if TEST_DEVICE == "cpu" and HAS_PACKING:
        layers.append(("packed", PackedLinear(linear, policy)))
    return layers


@pytest.mark.parametrize("name, layer", blocked_layers())
def test_in_blocks_a_row_does_not_depend_on_the_rest_of_the_batch(name, layer):
    x = torch.randn(70, 640, generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE)
    with torch.inference_mode():
        full = layer(x)
        for num_rows in range(1, 71):
            assert torch.equal(layer(x[:num_rows]), full[:num_rows]), (name, num_rows)
            assert torch.equal(layer(x[num_rows - 1:num_rows]), full[num_rows - 1:num_rows]), (name, num_rows)


@pytest.mark.parametrize("policy, num_rows, calls", [
    (RowPolicy(), 20, [(20, 4)]),
    (RowPolicy(block_rows=8), 20, [(8, 4)] * 3),
    (RowPolicy(block_rows=8), 16, [(8, 4)] * 2),
    (RowPolicy(min_rows=8), 5, [(8, 4)]),
    (RowPolicy(min_rows=8), 20, [(20, 4)]),
], ids=str)
def test_the_policy_decides_the_calls(policy, num_rows, calls):
    seen = []
    x = torch.randn(num_rows, 4)
    out = in_row_blocks(lambda rows: seen.append(tuple(rows.shape)) or rows * 2, x, policy)
    assert seen == calls and torch.equal(out, x * 2)


def varies_below(threshold: int):
    """A fake linear whose rows get other bits in calls of fewer than `threshold` rows (a kernel for small M)."""
    return lambda rows: rows * (1.0 + 1e-3 * (rows.shape[0] < threshold))


def test_the_probe_finds_what_varies_and_picks_the_cheapest_policy():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert not varies_with_rows(lambda rows: rows * 2, 4, cpu, f32)
    assert varies_with_rows(varies_below(3), 4, cpu, f32)
    assert not varies_with_rows(varies_below(3), 4, cpu, f32, RowPolicy(min_rows=4))
    assert choose_policy(lambda rows: rows * 2, 4, cpu, f32) == RowPolicy()
    assert choose_policy(varies_below(3), 4, cpu, f32) == RowPolicy(min_rows=4)
    assert choose_policy(varies_below(17), 4, cpu, f32) == RowPolicy(min_rows=32)
    every_count = lambda rows: rows * (1.0 + 1e-3 * rows.shape[0])  # noqa: E731
    assert choose_policy(every_count, 4, cpu, f32) == RowPolicy(block_rows=block_rows_for(cpu))
    assert max(PROBE_COUNTS) < 256 and set(range(1, 65)) <= set(PROBE_COUNTS)


def test_every_shape_of_the_model_is_probed_the_merged_ones_too(tiny_gemma3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is nn.Linear}
    assert set(choose_row_policies(model, is_packed=False)) == shapes
    if HAS_PACKING:
        attention = model.model.layers[0].self_attn
        qkv = (sum(getattr(attention, n).out_features for n in ("q_proj", "k_proj", "v_proj")),
               attention.q_proj.in_features)
        assert set(choose_row_policies(model, is_packed=True)) >= shapes | {qkv}


@pytest.mark.parametrize("is_packed", [True, False])
def test_the_runner_gives_every_linear_its_shapes_policy(tiny_gemma3_dir, monkeypatch, is_packed):
    import worker.loading as loading
    import worker.model_runner as model_runner

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    down = tuple(model.model.layers[0].mlp.down_proj.weight.shape)
    head = tuple(model.lm_head.weight.shape)
    chosen = {down: RowPolicy(min_rows=4), head: RowPolicy(block_rows=8)}
    monkeypatch.setattr(loading, "choose_row_policies", lambda model, packed: chosen)
    monkeypatch.setattr(packed_linear, "PACKING_MIN_WEIGHTS", 0)  # the tiny model's weights are packed too
    runner = model_runner.ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=16, block_size=4,
                                                   dtype="float32", device=TEST_DEVICE, is_packed_linear=is_packed))
    is_packing = is_packed and HAS_PACKING and TEST_DEVICE == "cpu"
    for module in (runner.model.model.layers[0].mlp.down_proj, runner.model.lm_head):
        assert isinstance(module, PackedLinear if is_packing else RowBlockLinear)
        assert module.policy == chosen[tuple(module.weight.shape)]
    others = runner.model.model.layers[0].self_attn.o_proj
    if is_packing:
        assert isinstance(others, PackedLinear) and others.policy == RowPolicy()
    else:
        assert type(others) is nn.Linear


def test_the_block_size_is_checked():
    with pytest.raises(ValueError, match="linear_block_rows"):
        WorkerConfig(linear_block_rows=-2)
