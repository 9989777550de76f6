"""Notebook 11 (trained transformer), exercise 11.4: wrong answers written from the statement."""

import torch

fro = torch.linalg.matrix_norm


def kc_no_transpose(w_qk, w_ov):
    return float(fro(w_qk @ w_ov) / (fro(w_qk) * fro(w_ov)))


def kc_trace_instead_of_norm(w_qk, w_ov):
    return float(torch.trace(w_qk @ w_ov.T).abs() / (fro(w_qk) * fro(w_ov)))


def kc_sum_of_norms(w_qk, w_ov):
    return float(fro(w_qk @ w_ov.T) / (fro(w_qk) + fro(w_ov)))


def kc_spectral_norm(w_qk, w_ov):
    n = lambda m: torch.linalg.matrix_norm(m, ord=2)
    return float(n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov)))


def kc_nuclear_norm(w_qk, w_ov):
    n = lambda m: torch.linalg.matrix_norm(m, ord="nuc")
    return float(n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov)))


def kc_entrywise_l1(w_qk, w_ov):
    n = lambda m: m.abs().sum()
    return float(n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov)))


def kc_cosine_of_flattened(w_qk, w_ov):
    a, b = w_qk.flatten(), w_ov.flatten()
    return float((a @ b).abs() / (a.norm() * b.norm()))


def kc_returns_tensor(w_qk, w_ov):
    return fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov))


def kc_squared_norms(w_qk, w_ov):
    return float(fro(w_qk @ w_ov.T) ** 2 / (fro(w_qk) ** 2 * fro(w_ov) ** 2))


def kc_q_composition(w_qk, w_ov):
    return float(fro(w_qk.T @ w_ov) / (fro(w_qk) * fro(w_ov)))


def kc_divided_by_sqrt_d(w_qk, w_ov):
    D = w_qk.shape[0]
    return float(fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov)) / D ** 0.5)


def kc_one_norm_only(w_qk, w_ov):
    return float(fro(w_qk @ w_ov.T) / fro(w_qk))


def kc_v_composition(w_qk, w_ov):
    return float(fro(w_ov @ w_qk) / (fro(w_qk) * fro(w_ov)))


def kc_norm_of_rows(w_qk, w_ov):
    n = lambda m: m.norm(dim=-1).max()  # "the norm" of each row, the largest
    return float(n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov)))


WRONG = {
    "k_composition_score": [
        ("W_QK @ W_OV without the transpose", kc_no_transpose),
        ("|trace(W_QK W_OV^T)| (the Frobenius inner product) instead of the norm",
         kc_trace_instead_of_norm),
        ("divided by the sum of the norms", kc_sum_of_norms),
        ("spectral norm (ord=2) instead of Frobenius", kc_spectral_norm),
        ("nuclear norm instead of Frobenius", kc_nuclear_norm),
        ("entrywise L1 norm", kc_entrywise_l1),
        ("cosine of the two flattened matrices", kc_cosine_of_flattened),
        ("returned a 0-d tensor instead of a float", kc_returns_tensor),
        ("ratio of squared norms (forgot the square roots)", kc_squared_norms),
        ("W_QK^T @ W_OV (the Q-composition product)", kc_q_composition),
        ("divided by sqrt(D) as well", kc_divided_by_sqrt_d),
        ("divided by ||W_QK|| only", kc_one_norm_only),
        ("W_OV @ W_QK (the V-composition order)", kc_v_composition),
        ("largest row norm instead of the Frobenius norm", kc_norm_of_rows),
    ],
}
