"""Notebook 07 (KV cache), exercise 7.4: wrong answers written from the statement."""

import math

import torch

# ---- 7.4 ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, t) -------------------------------


def _ring(q, k_new, v_new, k_buf, v_buf, t, *, copy=True, n_fn=None, slot_fn=None, tiled=False,
          attend_old=False, dim=-1, scale=None, write_v=True, return_old=False, roll=False,
          out_fp32=False):
    W = k_buf.shape[2]
    kb, vb = (k_buf.clone(), v_buf.clone()) if copy else (k_buf, v_buf)
    old_k, old_v = kb.clone(), vb.clone()
    if roll:
        kb = torch.cat([kb[:, :, 1:], k_new], dim=2)
        vb = torch.cat([vb[:, :, 1:], v_new], dim=2)
    else:
        slot = t % W if slot_fn is None else slot_fn(t, W)
        kb[:, :, slot] = k_new[:, :, 0]
        if write_v:
            vb[:, :, slot] = v_new[:, :, 0]
    n = min(t + 1, W) if n_fn is None else n_fn(t, W)
    if roll:
        K, V = kb[:, :, W - n:], vb[:, :, W - n:]
    else:
        K, V = (old_k, old_v) if attend_old else (kb, vb)
        K, V = K[:, :, :n], V[:, :, :n]
    rep = q.shape[1] // k_buf.shape[1]
    if tiled:
        K, V = K.repeat(1, rep, 1, 1), V.repeat(1, rep, 1, 1)
    else:
        K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.softmax(q @ K.transpose(-2, -1) * sc, dim=dim)
    o = p @ V
    if out_fp32:
        o = o.float()
    return (o, k_buf, v_buf) if return_old else (o, kb, vb)


def rb_in_place(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, copy=False)


def rb_all_slots(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, n_fn=lambda t, W: W)


def rb_next_slot(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, slot_fn=lambda t, W: (t + 1) % W)


def rb_n_is_t(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, n_fn=lambda t, W: max(1, min(t, W)))


def rb_gqa_tiled(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, tiled=True)


def rb_attend_then_write(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, attend_old=True)


def rb_softmax_over_query_axis(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, dim=-2)


def rb_scale_by_window(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, scale=1 / math.sqrt(k_buf.shape[2]))


def rb_window_minus_one(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, n_fn=lambda t, W: min(t + 1, W - 1))


def rb_value_not_written(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, write_v=False)


def rb_returns_input_buffers(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, return_old=True)


def rb_shift_left_and_append(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, roll=True)


def rb_float32_output(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, out_fp32=True)


def rb_slot_without_modulo(q, k_new, v_new, k_buf, v_buf, t):
    return _ring(q, k_new, v_new, k_buf, v_buf, t, slot_fn=lambda t, W: min(t, W - 1))


WRONG = {
    "ring_buffer_decode_step": [
        ("wrote into the given buffers in place (no copies)", rb_in_place),
        ("attended over all W slots, unwritten ones included", rb_all_slots),
        ("wrote the new token into slot (t + 1) % W", rb_next_slot),
        ("attended to min(t, W) slots (the new token left out before the buffer is full)",
         rb_n_is_t),
        ("GQA with .repeat: query head h reads kv head h % H_kv", rb_gqa_tiled),
        ("attended with the old buffers, then wrote the new token", rb_attend_then_write),
        ("softmax over the query axis (dim=-2)", rb_softmax_over_query_axis),
        ("scaled by 1/sqrt(W) instead of 1/sqrt(d)", rb_scale_by_window),
        ("a window of W - 1 slots once full", rb_window_minus_one),
        ("wrote k_new but forgot v_new", rb_value_not_written),
        ("attended over the updated copies but returned the given buffers",
         rb_returns_input_buffers),
        ("shifted the buffer left and appended (token p not in slot p % W)",
         rb_shift_left_and_append),
        ("returned o in float32 (input dtype not kept)", rb_float32_output),
        ("slot min(t, W - 1): once full, always overwrote the last slot", rb_slot_without_modulo),
    ],
}
