"""Notebook 10 (positions), exercise 10.3: wrong answers written from the statement."""

import math

import torch

# ---- 10.3 llama3_rope_frequencies(inv_freq, factor, low, high, L) --------------------------------


def _llama3(inv_freq, s, lo, hi, L, *, thresh_mul=False, smooth_from_ratio=False, no_two_pi=False,
            swap_tests=False, multiply=False, blend_reversed=False, smooth_no_low=False,
            in_place=False, out_fp32=False, middle_unscaled=False, ramp_by_index=False):
    theta = inv_freq
    lam = (1 / theta) if no_two_pi else (2 * math.pi / theta)
    if thresh_mul:
        high_wl, low_wl = L * hi, L * lo  # "L times the factor"
        keep, slow = lam < low_wl, lam > high_wl
    elif swap_tests:
        keep, slow = lam < L / lo, lam > L / hi
    else:
        keep, slow = lam < L / hi, lam > L / lo
    if ramp_by_index:
        n = theta.shape[0]
        smooth = 1 - torch.arange(n, dtype=theta.dtype) / max(1, n - 1)
    elif smooth_from_ratio:
        smooth = (lam / L - lo) / (hi - lo)
    elif smooth_no_low:
        smooth = (L / lam) / (hi - lo)
    else:
        smooth = (L / lam - lo) / (hi - lo)
    slowed = theta * s if multiply else theta / s
    if middle_unscaled:
        mid = (1 - smooth) * theta + smooth * theta
    elif blend_reversed:
        mid = smooth * slowed + (1 - smooth) * theta
    else:
        mid = (1 - smooth) * slowed + smooth * theta
    out = torch.where(keep, theta, torch.where(slow, slowed, mid))
    if in_place:
        inv_freq.copy_(out)
        out = inv_freq
    return out.float() if out_fp32 else out


def lr_thresholds_times_l(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   thresh_mul=True)


def lr_smooth_from_lambda_over_l(inv_freq, factor, low_freq_factor, high_freq_factor,
                                 original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   smooth_from_ratio=True)


def lr_wavelength_without_2pi(inv_freq, factor, low_freq_factor, high_freq_factor,
                              original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   no_two_pi=True)


def lr_low_high_swapped(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   swap_tests=True)


def lr_times_factor(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   multiply=True)


def lr_blend_reversed(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   blend_reversed=True)


def lr_smooth_without_low(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   smooth_no_low=True)


def lr_in_place(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   in_place=True)


def lr_float32(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   out_fp32=True)


def lr_middle_not_slowed(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   middle_unscaled=True)


def lr_ramp_by_pair_index(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                   ramp_by_index=True)


def lr_assumes_sorted(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # counts how many pairs keep / slow down and assumes inv_freq is sorted, largest first
    right = _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    lam = 2 * math.pi / inv_freq
    n_keep = int((lam < original_max_len / high_freq_factor).sum())
    n_slow = int((lam > original_max_len / low_freq_factor).sum())
    out = right.clone()
    n = inv_freq.shape[0]
    out[:n_keep] = inv_freq[:n_keep]
    out[n - n_slow:] = inv_freq[n - n_slow:] / factor
    return out


def lr_python_loop_list(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = []
    for th in inv_freq.tolist():
        lam = 2 * math.pi / th
        if lam < original_max_len / high_freq_factor:
            out.append(th)
        elif lam > original_max_len / low_freq_factor:
            out.append(th / factor)
        else:
            sm = (original_max_len / lam - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - sm) * th / factor + sm * th)
    return torch.tensor(out)


def lr_smooth_with_factor(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    theta = inv_freq
    lam = 2 * math.pi / theta
    smooth = (original_max_len / lam - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth / factor  # "scaled" the ramp as well
    mid = (1 - smooth) * theta / factor + smooth * theta
    keep = lam < original_max_len / high_freq_factor
    slow = lam > original_max_len / low_freq_factor
    return torch.where(keep, theta, torch.where(slow, theta / factor, mid))


WRONG = {
    "llama3_rope_frequencies": [
        ("thresholds computed as L * low and L * high", lr_thresholds_times_l),
        ("smooth factor from lambda / L instead of L / lambda", lr_smooth_from_lambda_over_l),
        ("wavelength 1/theta (forgot the 2 pi)", lr_wavelength_without_2pi),
        ("low and high freq factors swapped in the two tests", lr_low_high_swapped),
        ("multiplied by the factor instead of dividing", lr_times_factor),
        ("blend reversed: smooth * theta/s + (1 - smooth) * theta", lr_blend_reversed),
        ("smooth = (L / lambda) / (high - low), forgot to subtract low", lr_smooth_without_low),
        ("wrote the result into inv_freq in place", lr_in_place),
        ("returned float32 whatever inv_freq's dtype", lr_float32),
        ("middle band: forgot the / s in the blend (unchanged)", lr_middle_not_slowed),
        ("smooth ramp by pair index instead of by wavelength", lr_ramp_by_pair_index),
        ("assumed inv_freq sorted largest first (kept the first n_keep, slowed the last n_slow)",
         lr_assumes_sorted),
        ("Python loop, then torch.tensor(list): float32 for float64 input", lr_python_loop_list),
        ("divided the smooth ramp by the factor too", lr_smooth_with_factor),
    ],
}
