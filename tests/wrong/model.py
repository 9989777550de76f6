"""Learner-style wrong implementations for exercises 11.1-11.3, with the hint each check must give."""

import math

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------- 11.1 swiglu
def swiglu_gelu(x, w_gate, w_up, w_down):
    return (F.gelu(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_gelu_tanh(x, w_gate, w_up, w_down):
    return (F.gelu(x @ w_gate, approximate="tanh") * (x @ w_up)) @ w_down


def swiglu_sigmoid(x, w_gate, w_up, w_down):
    return (torch.sigmoid(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_relu(x, w_gate, w_up, w_down):
    return (torch.relu(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_wrong_branch(x, w_gate, w_up, w_down):
    return ((x @ w_gate) * F.silu(x @ w_up)) @ w_down


def swiglu_on_product(x, w_gate, w_up, w_down):
    return F.silu((x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_both_branches(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * F.silu(x @ w_up)) @ w_down


def swiglu_added(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) + x @ w_up) @ w_down


def swiglu_no_down(x, w_gate, w_up, w_down):
    return F.silu(x @ w_gate) * (x @ w_up)


def swiglu_transposed_down(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down.T


# ----------------------------------------------------------------- 11.2 causal_lm_loss
def _flat(logits, targets):
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def loss_sum(logits, targets):
    return F.cross_entropy(*_flat(logits, targets), reduction="sum")


def loss_mean_of_sequence_sums(logits, targets):
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, T]
    return per.sum(dim=1).mean()


def loss_shifted_again(logits, targets):
    # "next-token prediction": shifts a second time, although targets are already the next tokens.
    return F.cross_entropy(*_flat(logits[:, :-1], targets[:, 1:]))


def loss_nll_of_probabilities(logits, targets):
    probs = torch.softmax(logits, dim=-1)
    return F.nll_loss(*_flat(probs, targets))


def loss_nll_of_logits(logits, targets):
    return F.nll_loss(*_flat(logits, targets))


def loss_softmax_then_ce(logits, targets):
    return F.cross_entropy(*_flat(torch.softmax(logits, -1), targets))


def loss_bits(logits, targets):
    logp = torch.log_softmax(logits, -1)
    return -(logp.gather(-1, targets[..., None]) / math.log(2)).mean()


def loss_per_position(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def loss_classes_on_wrong_axis(logits, targets):
    return F.cross_entropy(logits, targets)  # classes are expected on axis 1


def loss_item(logits, targets):
    return F.cross_entropy(*_flat(logits, targets)).item()


def loss_rebuilt_from_numbers(logits, targets):
    # A loop over Python floats: right value, but no gradient reaches the logits.
    B, T, V = logits.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            row = logits[b, t].tolist()
            top = max(row)
            lse = top + math.log(sum(math.exp(v - top) for v in row))
            total += lse - row[int(targets[b, t])]
    return torch.tensor(total / (B * T), dtype=logits.dtype)


# ----------------------------------------------------------------- 11.3 induction_scores
def induction_duplicate_token(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m].mean(-1)


def induction_previous_token(attn):
    T = attn.shape[-1]
    i = torch.arange(T // 2, T)
    return attn[..., i, i - 1].mean(-1)


def induction_all_queries(attn):
    m = attn.shape[-1] // 2
    return attn.diagonal(offset=-(m - 1), dim1=-2, dim2=-1).mean(-1)


def induction_all_queries_padded(attn):
    T = attn.shape[-1]
    m = T // 2
    scores = torch.zeros(attn.shape[:2], dtype=attn.dtype)
    for i in range(T):
        j = i - m + 1
        if j >= 0:
            scores += attn[..., i, j]
    return scores / T


def induction_sum(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m + 1].sum(-1)


def induction_transposed(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i - m + 1, i].mean(-1)


def induction_one_number(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m + 1].mean()


def induction_float32_loop(attn):
    L, H, T, _ = attn.shape
    m = T // 2
    out = torch.zeros(L, H)  # float32 whatever attn's dtype
    for layer in range(L):
        for head in range(H):
            out[layer, head] = sum(attn[layer, head, i, i - m + 1] for i in range(m, T)) / m
    return out


WRONG = {
    "swiglu": [
        (swiglu_gelu, "you used GELU"),
        (swiglu_gelu_tanh, "you used GELU"),
        (swiglu_sigmoid, "original GLU"),
        (swiglu_relu, "ReGLU"),
        (swiglu_wrong_branch, "wrong branch"),
        (swiglu_on_product, "SiLU to the product"),
        (swiglu_both_branches, "both branches"),
        (swiglu_added, "you added the branches"),
        (swiglu_no_down, "down projection is missing"),
        (swiglu_transposed_down, "w_down is [F, D]"),
    ],
    "causal_lm_loss": [
        (loss_sum, "you summed the losses"),
        (loss_mean_of_sequence_sums, "per-sequence sums"),
        (loss_shifted_again, "shifted the targets again"),
        (loss_nll_of_probabilities, "NLL of probabilities"),
        (loss_nll_of_logits, "nll_loss of the raw logits"),
        (loss_softmax_then_ce, "softmax before F.cross_entropy"),
        (loss_bits, "in bits"),
        (loss_per_position, "one loss per position"),
        (loss_classes_on_wrong_axis, "classes on axis 1"),
        (loss_item, "no .item()"),
        (loss_rebuilt_from_numbers, "detached from the logits"),
    ],
    "induction_scores": [
        (induction_duplicate_token, "key i - m, the query's previous occurrence"),
        (induction_previous_token, "key i - 1"),
        (induction_all_queries, "from query m - 1 on"),
        (induction_all_queries_padded, "over all T queries"),
        (induction_sum, "summed over the queries"),
        (induction_transposed, "rows are queries"),
        (induction_one_number, "one score per head"),
        (induction_float32_loop, "expected dtype torch.float64"),
    ],
}
