"""Notebook 01 (Q, K, V and their shapes): wrong answers written from the statements."""

import math

import torch

# ---- 1.1 qkv_projection(x, w_qkv, n_heads) -> (q, k, v), each [B, H, T, D/H] -------------------


def _split(x, w_qkv):
    D = x.shape[-1]
    return (x @ w_qkv).split(D, dim=-1)


def _heads(t, H):
    B, T, D = t.shape
    return t.view(B, T, H, D // H).transpose(1, 2)


def qkv_kqv_order(x, w_qkv, n_heads):
    q, k, v = _split(x, w_qkv)
    return _heads(k, n_heads), _heads(q, n_heads), _heads(v, n_heads)


def qkv_view_no_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.reshape(B, n_heads, T, D // n_heads) for t in _split(x, w_qkv))


def qkv_heads_interleaved(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.view(B, T, D // n_heads, n_heads).permute(0, 3, 1, 2) for t in _split(x, w_qkv))


def qkv_no_head_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.view(B, T, n_heads, D // n_heads) for t in _split(x, w_qkv))


def qkv_heads_first(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.view(B, T, n_heads, D // n_heads).permute(2, 0, 1, 3) for t in _split(x, w_qkv))


def qkv_fused_interleaved_columns(x, w_qkv, n_heads):
    B, T, D = x.shape
    w = w_qkv.view(D, D, 3)  # read the fused matrix as (q, k, v) per output feature
    return tuple(_heads(x @ w[..., i], n_heads) for i in range(3))


def qkv_per_head_qkv_layout(x, w_qkv, n_heads):
    B, T, D = x.shape
    y = (x @ w_qkv).view(B, T, n_heads, 3, D // n_heads)  # GPT-NeoX's per-head layout
    return tuple(y[:, :, :, i].transpose(1, 2) for i in range(3))


def qkv_prescaled_q(x, w_qkv, n_heads):
    q, k, v = (_heads(t, n_heads) for t in _split(x, w_qkv))
    return q / math.sqrt(q.shape[-1]), k, v


def qkv_token_and_dk_swapped(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.view(B, T, n_heads, D // n_heads).permute(0, 2, 3, 1) for t in _split(x, w_qkv))


def qkv_v_copied_from_k(x, w_qkv, n_heads):
    q, k, v = (_heads(t, n_heads) for t in _split(x, w_qkv))
    return q, k, k


def qkv_transpose_then_reshape(x, w_qkv, n_heads):
    B, T, D = x.shape
    return tuple(t.transpose(1, 2).reshape(B, n_heads, T, D // n_heads) for t in _split(x, w_qkv))


def qkv_float64(x, w_qkv, n_heads):
    q, k, v = _split(x.double(), w_qkv.double())
    return _heads(q, n_heads), _heads(k, n_heads), _heads(v, n_heads)


# ---- 1.2 merge_heads(o) [B, H, T, d_k] -> [B, T, H*d_k] -----------------------------------------


def merge_no_transpose(o):
    B, H, T, dk = o.shape
    return o.reshape(B, T, H * dk)


def merge_interleaved(o):
    B, H, T, dk = o.shape
    return o.permute(0, 2, 3, 1).reshape(B, T, H * dk)


def merge_forgot_reshape(o):
    return o.transpose(1, 2)


def merge_batch_and_tokens_swapped(o):
    B, H, T, dk = o.shape
    return o.permute(2, 0, 1, 3).reshape(B, T, H * dk)


def merge_heads_reversed(o):
    return torch.cat([o[:, h] for h in reversed(range(o.shape[1]))], dim=-1)


def merge_sum_heads(o):
    return o.sum(dim=1)


def merge_cat_on_tokens(o):
    return torch.cat(o.unbind(1), dim=1)


def merge_t_and_dk_transposed(o):
    B, H, T, dk = o.shape
    return o.transpose(2, 3).reshape(B, T, H * dk)


def merge_t_from_axis_1(o):
    B, T = o.shape[0], o.shape[1]  # took T from axis 1 (that is H)
    return o.transpose(1, 2).reshape(B, T, -1)


def merge_heads_rolled(o):
    H = o.shape[1]
    return torch.cat([o[:, h % H] for h in range(1, H + 1)], dim=-1)


def merge_einsum_wrong_order(o):
    B, H, T, dk = o.shape
    return torch.einsum("bhtd->btdh", o).reshape(B, T, H * dk)


def merge_mean_heads_repeated(o):
    B, H, T, dk = o.shape
    return o.mean(dim=1).repeat(1, 1, H)


# ---- 1.3 scaled_dot_product_attention(q, k, v) --------------------------------------------------


def sdpa_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def sdpa_times_sqrt(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_divide_by_dk(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def sdpa_softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def sdpa_transpose_1_2(q, k, v):
    return torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_scale_by_dv(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1]), dim=-1) @ v


def sdpa_scale_by_tk(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2]), dim=-1) @ v


def sdpa_weights_transposed(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return p.transpose(-2, -1) @ v


def sdpa_no_max_subtraction(q, k, v):
    e = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return e / e.sum(-1, keepdim=True) @ v


def sdpa_scale_after_softmax(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v / math.sqrt(q.shape[-1])


def sdpa_causal_by_habit(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T_q, T_k = s.shape[-2:]
    keep = torch.ones(T_q, T_k, dtype=torch.bool, device=s.device).tril()
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


def sdpa_softmax_whole_matrix(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.flatten(-2), dim=-1).view_as(s)
    return p @ v


WRONG = {
    "qkv_projection": [
        ("returns (k, q, v): took Q from the K columns", qkv_kqv_order),
        ("reshaped [B, T, D] straight to [B, H, T, d_k] without the transpose",
         qkv_view_no_transpose),
        ("split each head's features as strided columns h::H (view(B, T, d_k, H))",
         qkv_heads_interleaved),
        ("forgot the transpose: returns [B, T, H, d_k]", qkv_no_head_transpose),
        ("heads moved in front of the batch: [H, B, T, d_k]", qkv_heads_first),
        ("read w_qkv as interleaved (q, k, v) per column instead of three blocks",
         qkv_fused_interleaved_columns),
        ("assumed a per-head [q, k, v] layout (GPT-NeoX style) in the fused output",
         qkv_per_head_qkv_layout),
        ("baked the 1/sqrt(d_k) scale into q", qkv_prescaled_q),
        ("permuted to [B, H, d_k, T] (token and head-dim axes swapped)", qkv_token_and_dk_swapped),
        ("copy-paste: returned k in place of v", qkv_v_copied_from_k),
        ("transposed [B, T, D] to [B, D, T] and then reshaped into heads",
         qkv_transpose_then_reshape),
        ("computed in float64 for accuracy and did not cast back", qkv_float64),
    ],
    "merge_heads": [
        ("reshaped [B, H, T, d_k] straight to [B, T, H*d_k] without the transpose",
         merge_no_transpose),
        ("interleaved the heads: column d*H + h instead of h*d_k + d", merge_interleaved),
        ("transposed but forgot the reshape: returns [B, T, H, d_k]", merge_forgot_reshape),
        ("permuted to [T, B, H, d_k] and reshaped (batch and tokens mixed)",
         merge_batch_and_tokens_swapped),
        ("concatenated the heads in reverse order", merge_heads_reversed),
        ("summed over the heads instead of concatenating", merge_sum_heads),
        ("concatenated the heads along the token axis", merge_cat_on_tokens),
        ("transposed T with d_k instead of H with T, then reshaped", merge_t_and_dk_transposed),
        ("took T from o.shape[1] (the head axis) in the final reshape", merge_t_from_axis_1),
        ("off-by-one loop over heads: head h+1 lands in head h's columns", merge_heads_rolled),
        ("einsum 'bhtd->btdh' (head axis last) then reshape", merge_einsum_wrong_order),
        ("averaged the heads and tiled the mean H times", merge_mean_heads_repeated),
    ],
    "scaled_dot_product_attention": [
        ("forgot the 1/sqrt(d_k) scale", sdpa_no_scale),
        ("multiplied by sqrt(d_k) instead of dividing", sdpa_times_sqrt),
        ("divided by d_k instead of sqrt(d_k)", sdpa_divide_by_dk),
        ("softmax over the query axis (dim=-2)", sdpa_softmax_over_queries),
        ("k.transpose(1, 2): right for 3-D inputs, wrong with a head axis", sdpa_transpose_1_2),
        ("scaled by sqrt(d_v) (v.shape[-1]) instead of sqrt(d_k)", sdpa_scale_by_dv),
        ("scaled by sqrt(T_k) instead of sqrt(d_k)", sdpa_scale_by_tk),
        ("transposed the attention weights before multiplying by v", sdpa_weights_transposed),
        ("hand-written softmax without subtracting the max (overflows)", sdpa_no_max_subtraction),
        ("applied the scale to the output after the softmax", sdpa_scale_after_softmax),
        ("added a causal mask out of habit (the statement says no mask)", sdpa_causal_by_habit),
        ("softmax over the whole score matrix instead of each row", sdpa_softmax_whole_matrix),
    ],
}
