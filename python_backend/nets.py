"""The networks, built from a fixed seed: a bidirectional encoder (``embed``), a cross-encoder
(``rerank``: the same encoder, scoring a query+document pair) and a causal decoder.

All are deliberately small (d_model 128, 4 heads, feed-forward 256, pre-norm layers: 1 in
the encoders, 2 in the decoder) so that one full batch costs tens of milliseconds on one CPU
thread, yet real: a scheduler in front of them sees service times that grow with rows and
tokens the way a production model's do.

One code path per network, whatever the batch looks like. Each call site of
``scaled_dot_product_attention`` always passes the same kind of mask: the encoder an
additive key mask built from the lengths (all zeros when every row is full), the decoder's
prompt pass ``is_causal=True``, each decode step a key mask built from positions. The kernel
PyTorch picks depends on dtype, device and mask kind, which never vary here, so a row alone
and the same row padded in a batch go through the same arithmetic; only tensor widths
differ, hence at most float rounding. (Written-out ``softmax(q kᵀ) v`` was measured 2-6x
slower on these CPUs and materialises ``L x L`` scores, 64 MiB per row at 2048 tokens; the
fused kernel does not.) The encoder scripts with ``torch.jit.script`` (``export_torchscript``).

Invariants the serving code relies on:
- ``TokenEncoder`` and ``CrossEncoder`` mask keys at positions ``>= length``: a row's
  embedding or score does not depend on what is in its padding, and no query sees an
  all-masked row (lengths are ``>= 1``).
- ``CausalDecoder`` lets position ``p`` attend to positions ``<= p`` only, so anything to
  the right of a row's last real token (padding, scratch) cannot change that row's logits
  at its last token. Its cached ``prefill``/``step`` compute what ``forward`` (no cache,
  the reference) computes, up to float rounding.
- Positions are sinusoidal, precomputed up to ``MAX_POSITIONS``; there is no learned
  position table, and callers must keep sequences within ``MAX_POSITIONS``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 4096  # the decoder's head reads all of it per step: 8192 cost 1.6x per decode
D_MODEL = 128
N_HEADS = 4
# Layers: sized so one full batch costs 5-50 ms on one thread of these CPUs (figures in
# model_repository/README.md). A 2-layer encoder took 55-75 ms for 32 x 128 tokens; the
# decoder's work per full batch is smaller (8 rows, one token per row per step).
EMBED_LAYERS = 1
RERANK_LAYERS = 1  # a pair is a row of embed's kind: the same cost per token
GENERATE_LAYERS = 2
D_FF = 256
MAX_POSITIONS = 4096
EMBED_SEED = 20240601
GENERATE_SEED = 20240602
RERANK_SEED = 20240603


def sinusoidal_table(max_positions: int, d_model: int) -> Tensor:
    """``[max_positions, d_model]`` sin/cos positions (Vaswani et al.), float32."""
    position = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    table = torch.zeros(max_positions, d_model)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


class SelfAttention(nn.Module):
    """Multi-head self-attention: causal, or with an additive key mask (0 or -inf)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.causal:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + attn(ln(x))``, then ``x + ff(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, causal: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), key_mask)
        return x + self.ff(self.ln2(x))


class Trunk(nn.Module):
    """Token embedding + sinusoidal positions + layers + final norm, shared by both nets."""

    if TYPE_CHECKING:  # for mypy only: TorchScript cannot resolve string annotations
        positions: Tensor  # buffer [MAX_POSITIONS, d_model]

    def __init__(
        self, vocab: int, d_model: int, n_heads: int, n_layers: int, d_ff: int, causal: bool
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.tokens = nn.Embedding(vocab, d_model)
        self.register_buffer("positions", sinusoidal_table(MAX_POSITIONS, d_model))
        self.layers = nn.ModuleList(
            [Block(d_model, n_heads, d_ff, causal) for _ in range(n_layers)]
        )
        self.ln = nn.LayerNorm(d_model)

    def forward(self, ids: Tensor, key_mask: Tensor) -> Tensor:
        """``[B, L]`` int64 ids in ``[0, vocab)`` -> ``[B, L, d_model]``."""
        x = self.tokens(ids) + self.positions[: ids.shape[1]].unsqueeze(0)
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.ln(x)


class TokenEncoder(nn.Module):
    """Bidirectional encoder with masked mean pooling: ``[B, L]`` ids -> ``[B, d_model]``."""

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        n_layers: int = EMBED_LAYERS,
        d_ff: int = D_FF,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.trunk = Trunk(vocab, d_model, n_heads, n_layers, d_ff, causal=False)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        """``ids`` int64 ``[B, L]`` in range; ``lengths`` int64 ``[B]`` in ``[1, L]``."""
        valid = valid_positions(ids, lengths)
        h = self.trunk(ids, key_mask_of(valid))
        weights = valid.to(h.dtype).unsqueeze(2)
        return (h * weights).sum(dim=1) / lengths.to(h.dtype).unsqueeze(1)


class CrossEncoder(nn.Module):
    """A cross-encoder reranker: ``[B, L]`` ids of ``[CLS] query [SEP] document [SEP]``
    -> one relevance logit per row, ``[B]``.

    The encoder of ``TokenEncoder`` (bidirectional, keys masked past each row's length),
    read at the first position (the ``[CLS]`` token, as BERT-style cross-encoders do) by a
    linear head. Query and document see each other in every layer; that joint reading is
    what makes a cross-encoder rank better, and cost more, than comparing two embeddings.
    """

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        n_layers: int = RERANK_LAYERS,
        d_ff: int = D_FF,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.trunk = Trunk(vocab, d_model, n_heads, n_layers, d_ff, causal=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        """``ids`` int64 ``[B, L]`` in range; ``lengths`` int64 ``[B]`` in ``[1, L]``."""
        h = self.trunk(ids, key_mask_of(valid_positions(ids, lengths)))
        return self.head(h[:, 0]).squeeze(1)


def valid_positions(ids: Tensor, lengths: Tensor) -> Tensor:
    """``[B, L]`` bool: position ``p`` of row ``b`` holds a real token (``p < lengths[b]``)."""
    width = ids.shape[1]
    return torch.arange(width, device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)


def key_mask_of(valid: Tensor) -> Tensor:
    """``[B, 1, 1, L]`` additive mask (0 or -inf): every query of row b may look at its
    real tokens only."""
    key_mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    return key_mask.masked_fill(~valid, float("-inf")).unsqueeze(1).unsqueeze(1)


class CausalDecoder(nn.Module):
    """Decoder-only language model with a key/value cache for greedy decoding.

    ``prefill`` runs the (right-padded) prompts once with causal attention and keeps every
    layer's keys and values in a cache ``[B, heads, width, d_head]``; ``step`` then feeds
    one new token per row at that row's own position ``pos[b]``: it writes the token's
    key/value into slot ``pos[b]`` (overwriting padding or nothing) and attends to slots
    ``<= pos[b]`` only. Slots beyond a row's position (its padding, or scratch left by a
    longer neighbour) are masked, so a row decodes the same tokens alone or in a batch.
    """

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        n_layers: int = GENERATE_LAYERS,
        d_ff: int = D_FF,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.trunk = Trunk(vocab, d_model, n_heads, n_layers, d_ff, causal=True)
        # Untied head: with tied weights a random model mostly repeats its last token.
        self.head = nn.Linear(d_model, vocab, bias=False)

    def _blocks(self) -> list[Block]:
        return [cast(Block, layer) for layer in self.trunk.layers]

    def forward(self, ids: Tensor, last: Tensor) -> Tensor:
        """The reference, without a cache: logits ``[B, vocab]`` at position ``last[b]``.

        One full causal pass over ``ids`` ``[B, L]``; decoding with it costs a pass per
        token, which is what ``prefill``/``step`` avoid.
        """
        h = self.trunk(ids, torch.empty(0))
        rows = torch.arange(ids.shape[0], device=ids.device)
        return self.head(h[rows, last])

    def prefill(self, ids: Tensor, lengths: Tensor, width: int) -> tuple[Tensor, list[Tensor]]:
        """Next-token logits ``[B, vocab]`` after each prompt, and the cache (``width`` slots).

        ``ids`` int64 ``[B, L]``, right-padded; ``lengths`` int64 ``[B]`` in ``[1, L]``;
        ``width >= L`` is the number of positions the caller will decode up to.
        """
        b, n = ids.shape
        trunk = self.trunk
        x = trunk.tokens(ids) + trunk.positions[:n].unsqueeze(0)
        cache: list[Tensor] = []
        for layer in self._blocks():
            attn = layer.attn
            qkv = attn.qkv(layer.ln1(x)).view(b, n, 3, attn.n_heads, attn.d_head)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            kv = x.new_zeros((2, b, attn.n_heads, width, attn.d_head))
            kv[0, :, :, :n] = k
            kv[1, :, :, :n] = v
            cache.append(kv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + attn.out(y.transpose(1, 2).reshape(b, n, -1))
            x = x + layer.ff(layer.ln2(x))
        rows = torch.arange(b, device=ids.device)
        return self.head(trunk.ln(x[rows, lengths - 1])), cache

    def step(self, tokens: Tensor, pos: Tensor, cache: list[Tensor]) -> Tensor:
        """Feed ``tokens[b]`` at position ``pos[b]``; logits ``[B, vocab]`` for the next one."""
        b = tokens.shape[0]
        trunk = self.trunk
        rows = torch.arange(b, device=tokens.device)
        x = (trunk.tokens(tokens) + trunk.positions[pos]).unsqueeze(1)
        seen = int(pos.max()) + 1  # slots any row can see this step
        visible = torch.arange(seen, device=tokens.device).unsqueeze(0) <= pos.unsqueeze(1)
        key_mask = torch.zeros(visible.shape, dtype=x.dtype, device=tokens.device)
        key_mask = key_mask.masked_fill(~visible, float("-inf")).unsqueeze(1).unsqueeze(1)
        for layer, kv in zip(self._blocks(), cache, strict=True):
            attn = layer.attn
            qkv = attn.qkv(layer.ln1(x)).view(b, 3, attn.n_heads, attn.d_head)
            kv[0, rows, :, pos] = qkv[:, 1]
            kv[1, rows, :, pos] = qkv[:, 2]
            q = qkv[:, 0].unsqueeze(2)  # [B, heads, 1, d_head]
            y = F.scaled_dot_product_attention(
                q, kv[0, :, :, :seen], kv[1, :, :, :seen], attn_mask=key_mask
            )
            x = x + attn.out(y.transpose(1, 2).reshape(b, 1, -1))
            x = x + layer.ff(layer.ln2(x))
        return self.head(trunk.ln(x[:, 0]))


def build_encoder(seed: int = EMBED_SEED) -> TokenEncoder:
    """The ``embed`` network; the same seed gives bit-identical weights on every build."""
    torch.manual_seed(seed)
    return TokenEncoder().eval()


def build_decoder(seed: int = GENERATE_SEED) -> CausalDecoder:
    """The ``generate`` network; the same seed gives bit-identical weights on every build."""
    torch.manual_seed(seed)
    return CausalDecoder().eval()


def build_cross_encoder(seed: int = RERANK_SEED) -> CrossEncoder:
    """The ``rerank`` network; the same seed gives bit-identical weights on every build."""
    torch.manual_seed(seed)
    return CrossEncoder().eval()
