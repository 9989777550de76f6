"""Notebook 08 (FLOPs and memory), exercise 8.4: wrong answers written from the statement."""

from helpers.nb08_flops_memory import dense_param_count


def _mem(cfg, batch, seq_len, attention, *, naive_t2=False, naive_hkv=False, rec_extra=True,
         head=True, opt=12, act_bytes=2, w_bytes=2, total_acts=True, kv_h=False,
         rec_minus_d=True, as_float=False, use_batch=True, naive_once=False, head_v_only=False):
    N = dense_param_count(cfg)
    d, L, H, Hkv, dh, dff, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                cfg.head_dim, cfg.d_ff, cfg.vocab)
    flash = 4 * d + 2 * H * dh + 2 * (H if kv_h else Hkv) * dh + 4 * dff
    if attention == "naive":
        extra = (Hkv if naive_hkv else H) * seq_len * (seq_len if naive_t2 else 1)
        layer = flash + (0 if naive_once else extra)
        per_token = L * layer + (extra if naive_once else 0)
    elif attention == "flash":
        per_token = L * flash
    else:
        per_token = L * d + ((flash - d if rec_minus_d else flash) if rec_extra else 0)
    if head:
        per_token += V if head_v_only else 2 * d + V
    acts = act_bytes * (batch if use_batch else 1) * seq_len * per_token
    out = {"weights": w_bytes * N, "gradients": 2 * N, "optimizer": opt * N, "activations": acts}
    out["total"] = sum(out.values()) if total_acts else out["weights"] + out["gradients"] + \
        out["optimizer"]
    if as_float:
        out = {k: v / 1.0 for k, v in out.items()}
    return out


def tm_naive_t_squared(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, naive_t2=True)


def tm_naive_kv_heads(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, naive_hkv=True)


def tm_recompute_no_extra_layer(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, rec_extra=False)


def tm_no_head(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, head=False)


def tm_optimizer_8n(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, opt=8)


def tm_activations_one_byte(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, act_bytes=1)


def tm_weights_fp32(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, w_bytes=4)


def tm_total_without_activations(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, total_acts=False)


def tm_kv_with_query_heads(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, kv_h=True)


def tm_recompute_full_layer(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, rec_minus_d=False)


def tm_floats(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, as_float=True)


def tm_batch_ignored(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, use_batch=False)


def tm_naive_probabilities_once(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, naive_once=True)


def tm_head_vocab_only(cfg, batch, seq_len, attention):
    return _mem(cfg, batch, seq_len, attention, head_v_only=True)


def tm_fixes_cfg_in_place(cfg, batch, seq_len, attention):
    # "head_dim is d_model / n_heads", written back into the frozen config
    object.__setattr__(cfg, "head_dim", cfg.d_model // cfg.n_heads)
    return _mem(cfg, batch, seq_len, attention)


def tm_naive_sets_mha_in_cfg(cfg, batch, seq_len, attention):
    if attention == "naive":  # "naive attention has no GQA": one K/V head per query head
        object.__setattr__(cfg, "n_kv_heads", cfg.n_heads)
    return _mem(cfg, batch, seq_len, attention)


WRONG = {
    "training_memory": [
        ("naive adds H * T * T per token (the whole score matrix per token)", tm_naive_t_squared),
        ("naive adds H_kv * T instead of H * T", tm_naive_kv_heads),
        ("recompute keeps only d per layer, forgot the layer being recomputed",
         tm_recompute_no_extra_layer),
        ("forgot the head's 2d + V per token", tm_no_head),
        ("optimizer 8N: forgot the fp32 master weights", tm_optimizer_8n),
        ("activations counted at 1 byte per number", tm_activations_one_byte),
        ("weights at 4 bytes (fp32) instead of bf16", tm_weights_fp32),
        ("total leaves out the activations", tm_total_without_activations),
        ("K and V counted with H heads instead of H_kv", tm_kv_with_query_heads),
        ("recompute adds a whole flash layer (did not subtract d)", tm_recompute_full_layer),
        ("returned floats instead of ints", tm_floats),
        ("activations for one sequence (batch ignored)", tm_batch_ignored),
        ("naive's H * T added once, not in each of the L layers", tm_naive_probabilities_once),
        ("the head saves V per token, forgot its 2d", tm_head_vocab_only),
        ("set cfg.head_dim = d_model // n_heads in place with object.__setattr__",
         tm_fixes_cfg_in_place),
        ("naive: set cfg.n_kv_heads = n_heads in place (object.__setattr__), as if MHA",
         tm_naive_sets_mha_in_cfg),
    ],
}
