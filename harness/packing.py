"""The padding-free (packed) forward's pieces: a micro-batch's trajectories in one row, each attending only to itself.

`pack_shared` turns right-padded rows (`tensorize`'s layout) into one row (1, N) of their real tokens, each prefix that
trajectories of the micro-batch share held once (the system prompt every trajectory starts with, a question's prompt
over its k trajectories, a tree's branch over the chains through it; share=False: none), a token's position that in its
trajectory, and the layout (`SharedPrefixes`). The model's forward hands the layout (`SharedPrefixes.kwargs`: with
nothing shared, the trajectories' boundaries as transformers' flash-attention varlen path reads them, `boundaries`)
down to `attention`, an attention function registered with transformers as ATTENTION, which runs causal attention per
trajectory (over its shared prefix too: `shared_prefix_attention`): projections, MLPs and norms see no padding and no
shared prefix twice, and attention costs Σ L_i² instead of B · L². The same values and gradients: a causal LM's hidden
state at a token depends only on the tokens up to it. A call without boundaries (generation with its KV cache and left
padding, the padded path) goes to transformers' own sdpa_attention_forward with sdpa's mask, so a model switched to
ATTENTION (`use_packed_attention`) computes everything else as before. `SharedPrefixes.unpack` takes the scored
positions back out of the row. A Policy (harness/run/policy.py) decides once, when it is built, whether its forward
packs (`supported` says for which models the packed path is exact), and then switches its model to ATTENTION, once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION = "packed_sdpa"
MODEL_TYPES = ("llama", "qwen2", "qwen3")        # checked equal to the padded forward in tests/test_packing.py


def supported(config) -> bool:
    """Whether the packed forward computes what the padded one does for a model of this config: a model type whose
    forward hands the boundaries down to its attention (MODEL_TYPES, checked), full attention in every layer (no
    sliding window) and sdpa attention, which ATTENTION extends. Other models take the padded path."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (config.model_type in MODEL_TYPES and layer_types == {"full_attention"}
            and getattr(config, "sliding_window", None) is None and config._attn_implementation in ("sdpa", ATTENTION))


def use_packed_attention(decoder) -> None:
    """Register `attention` with transformers as ATTENTION, its masks sdpa's (an all-ones mask, a packed row's, is
    none), and route the decoder's attention through it: transformers' sdpa for every call without boundaries. Called
    once per model, when a Policy that packs is built."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    if decoder.config._attn_implementation != ATTENTION:
        decoder.set_attn_implementation(ATTENTION)


def boundaries(cu_seqlens: torch.Tensor, lengths: torch.Tensor) -> dict:
    """The trajectories' boundaries as a model's forward passes them on to its attention function (the names of
    transformers' flash-attention varlen path)."""
    longest = int(lengths.max())
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
              max_length_q: int | None = None, shared_prefixes: SharedPrefixes | None = None, **kwargs):
    """ATTENTION. query (1, H, N, d), key and value (1, H_kv, N, d) of a packed row whose trajectory i spans
    [cu_seq_lens_q[i], cu_seq_lens_q[i+1]) -> (1, N, H, d), the layout of transformers' sdpa_attention_forward:
    softmax(q·kᵀ·scaling) v with each query seeing the keys of its own trajectory up to itself. Without cu_seq_lens_q
    this is sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if cu_seq_lens_q is None and shared_prefixes is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or is_causal is False or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"packed attention is causal full attention over one row without a cache (got {unsupported}, "
                         f"is_causal={is_causal}, query {tuple(query.shape)}, key {tuple(key.shape)})")
    if shared_prefixes is not None:
        return shared_prefix_attention(module, query, key, value, dropout, scaling, shared_prefixes), None
    if use_flash(query):
        return flash_varlen(module, query, key, value, dropout, scaling, cu_seq_lens_q, max_length_q), None
    return sdpa_per_trajectory(module, query, key, value, dropout, scaling, cu_seq_lens_q), None


def use_flash(query: torch.Tensor) -> bool:
    """flash-attention 2's varlen kernel where it runs (the package installed, the tensors on CUDA), else SDPA per
    trajectory. This project's machines have no flash-attn: the flash path is not exercised by its tests."""
    from transformers.utils import is_flash_attn_2_available
    return query.is_cuda and is_flash_attn_2_available()


def flash_varlen(module, query, key, value, dropout, scaling, cu_seqlens, max_length) -> torch.Tensor:
    """transformers' flash_attention_2 varlen path on the packed row (what flash_attention_forward calls, with the
    implementation named: ATTENTION is no flash implementation) -> (1, N, H, d). Untested here (no flash-attn)."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward
    return _flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, query_length=query.shape[2],
        is_causal=True, dropout=dropout, softmax_scale=scaling, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
        max_length_q=max_length, max_length_k=max_length, target_dtype=get_target_dtype(query, module),
        attn_implementation="flash_attention_2")


def sdpa_per_trajectory(module, query, key, value, dropout, scaling, cu_seqlens) -> torch.Tensor:
    """torch SDPA (is_causal) per trajectory, the trajectories of one length in one call -> (1, N, H, d)."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and not use_gqa_in_sdpa(None, key, value):
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    starts_by_length: dict[int, list[int]] = {}
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    order, outputs = [], []
    for length, starts in starts_by_length.items():
        index = (torch.tensor(starts, device=query.device)[:, None]
                 + torch.arange(length, device=query.device)).flatten()           # (G·L_g,) the group's tokens
        q, k, v = (x[0][:, index].unflatten(1, (len(starts), length)).transpose(0, 1) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                                               is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        outputs.append(out.transpose(1, 2).flatten(0, 1))                          # (G·L_g, H, d)
        order.append(index)
    return torch.cat(outputs)[torch.argsort(torch.cat(order))][None]


@dataclass
class SharedPrefixes:
    """A micro-batch packed with every shared prefix computed once (`pack_shared`). Trajectory i (L_i tokens) shares
    its first `first[i]` tokens with an earlier trajectory of the micro-batch (the longest common prefix with any of
    them: the prompt, the system prompt, a tree's branch), so the row holds only its tokens from first[i] on, at
    [starts[i], starts[i] + L_i − first[i]); path (B, max L_i) gives the row index of each of its tokens, shared or its
    own (0 past L_i). A causal LM's hidden state at a token depends only on the tokens up to it, so a shared token's
    is the same for every trajectory through it: the values, and the gradients summed over the trajectories, are those
    of the trajectories run apart."""
    starts: list[int]
    first: list[int]
    lengths: list[int]
    path: torch.Tensor

    @property
    def shares(self) -> bool:
        return any(self.first)

    def kwargs(self) -> dict:
        """What the model's forward hands down to `attention`: the layout itself where a prefix is shared, else the
        plain packed row's boundaries (flash-attention's varlen path on GPUs)."""
        if self.shares:
            return {"shared_prefixes": self}
        lengths = torch.tensor(self.lengths, device=self.path.device)
        return boundaries(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32), lengths)

    def unpack(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden (1, N, D) of the row -> (n, D) at the n positions where mask (B, L-1) is 1, in the order of the padded
        layout's `hidden[:, :-1][mask]` (a shared position's hidden state, once per trajectory that scores it)."""
        rows, cols = mask.bool().nonzero(as_tuple=True)
        lengths = torch.tensor(self.lengths, device=mask.device)
        if bool((cols + 1 >= lengths[rows]).any()):
            raise ValueError("mask is 1 at a position whose next token is not in its trajectory (padding)")
        return hidden[0, self.path[rows, cols]]


def pack_shared(input_ids: torch.Tensor, attention_mask: torch.Tensor, share: bool = True):
    """Right-padded rows -> one row holding each shared prefix once: ids (1, N), position_ids (1, N) (a token's
    position in its trajectory) and the SharedPrefixes layout; N = Σ (L_i − first[i]). With no prefix shared this is
    a row of every real token, positions restarting at 0 per trajectory (as with share=False)."""
    real = attention_mask.bool()
    lengths = real.sum(1)
    columns = torch.arange(real.shape[1], device=real.device)
    if not torch.equal(real, columns < lengths[:, None]):
        raise ValueError("packing needs right-padded rows (each row's real tokens first, then its padding)")
    path = torch.zeros_like(input_ids)
    starts, first, pieces, positions, n = [], [], [], [], 0
    for i, length in enumerate(lengths.tolist()):
        b = 0
        if i and share:
            same = ((input_ids[:i] == input_ids[i]) & real[:i] & real[i]).int().cumprod(1).sum(1)   # common prefixes
            j = int(same.argmax())
            b = int(same[j])
            path[i, :b] = path[j, :b]
        path[i, b:length] = torch.arange(n, n + length - b, device=path.device)
        starts.append(n)
        first.append(b)
        pieces.append(input_ids[i, b:length])
        positions.append(columns[b:length])
        n += length - b
    layout = SharedPrefixes(starts, first, lengths.tolist(), path)
    return torch.cat(pieces)[None], torch.cat(positions)[None], layout


def shared_prefix_attention(module, query, key, value, dropout, scaling, layout: SharedPrefixes) -> torch.Tensor:
    """Attention over a `pack_shared` row -> (1, N, H, d): each trajectory's own queries against the keys of its whole
    path (its shared prefix, wherever in the row it lies, then its own tokens), causal in its positions. One SDPA
    call per trajectory that owns tokens."""
    outputs = []
    for start, b, length, path in zip(layout.starts, layout.first, layout.lengths, layout.path):
        own = length - b
        if own == 0:
            continue
        q = query[:, :, start:start + own]
        k, v = (x.index_select(2, path[:length]) for x in (key, value))
        allowed = None
        if b:
            allowed = (torch.arange(length, device=q.device)[None, :]
                       <= torch.arange(b, length, device=q.device)[:, None])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                               scale=scaling, is_causal=not b,
                                                               enable_gqa=k.shape[1] != q.shape[1])
        outputs.append(out[0].transpose(0, 1))                                      # (own, H, d)
    return torch.cat(outputs)[None]
