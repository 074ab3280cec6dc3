"""POST /tokenize and POST /detokenize, in vLLM's shapes, for clients that count or inspect tokens.

/tokenize takes a completion `prompt` or chat `messages` (exactly one) and
tokenizes them as generation would (prompts.py: the tokenizer's special tokens
for a prompt, the chat template with its generation prompt for messages), so
`count` is what a request with the same input is charged against
`max_model_len`. /detokenize turns token ids back into text. Both want the API
key as /v1 does (router/guard.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.prompts import chat_prompt_ids, completion_prompt_ids
from router.protocol import ChatMessage, template_messages
from router.state import StateDep

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    return_token_strs: bool = False
    """Also return each token's text."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of `prompt` and `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    state.check_model(body.model)
    if body.messages is not None:
        ids = chat_prompt_ids(state.tokenizer, template_messages(body.messages))
    else:
        ids = completion_prompt_ids(state.tokenizer, body.prompt)
    strs = [state.token_texts.get(token)[0] for token in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.model_info.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    state.check_model(body.model)
    return DetokenizeResponse(prompt=state.decode(body.tokens, "tokens"))
