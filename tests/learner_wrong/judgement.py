"""Hand judgement of each wrong answer's baseline feedback (BASELINE.md).

CODES[exercise] has one letter per wrong answer, in the order of that exercise's WRONG list:
n named (the feedback names this mistake, or gives a fact that says exactly what to change),
g generic (shape / NaN / values-differ text only, or a fact that does not say what to change),
w wrong-cause (it names a different mistake), a accepted (the check passed it; a passing run is
always `accepted` whatever the letter). NOTES[(exercise, number)] explains a judgement (1-based).
"""

import importlib

CODES = {
    # nb01
    "qkv_projection": "nnnnnggnnngn",
    "merge_heads": "nnngnnnngngg",
    "scaled_dot_product_attention": "nnnnnnwnannn",
    # nb02
    "scaled_scores": "nnnnnnnnnang",
    "attention_entropy": "nnnnnnnnnnnn",
    "dot_product_std": "nnnnnnnnwgwnn",
    # nb03
    "causal_mask": "nnnnnnngnnn",
    "padding_mask": "nnnnnnggggng",
    "masked_softmax": "nnnngnnnnang",
    "prefix_lm_mask": "nnnnnnnnggn",
    "packed_causal_mask": "nnnnggnngnngg",
    "find_mask_leaks": "nnngwnngwggw",
    # nb04
    "softmax_jacobian": "nnnnnnnnngng",
    "softmax_backward": "nnnnnnnnnngg",
    "attention_backward": "nnngnnnnnnngn",
    # nb07, nb08
    "ring_buffer_decode_step": "nnnnnwggggnnnn",
    "training_memory": "gnnnnnnnnnnnwggg",
    # nb09
    "online_softmax": "nnnnnnnnggngg",
    "flash_attention_tiled": "nnnnnnnnnggggn",
    "flash_attention_triton": "nnnnnnnnnnnnn",
    "flash_attention_triton_backward": "nnnngnngngggn",
    # nb10, nb11
    "llama3_rope_frequencies": "ggnnnngnnnggng",
    "k_composition_score": "nggnnggnnngnng",
    # nb12
    "gather_paged_kv": "annngggnnnngg",
    "merge_partials": "gwgnwnnnngnan",
    "blocks_in_use": "gnnnnngwgnwnng",
    "paged_decode_triton": "ngnggggnnnnng",
}

NOTES = {
    ("qkv_projection", 5): "fact: the axes in another order, [1, 0, 2, 3]",
    ("qkv_projection", 7): "fact: head 0 right, heads 1..2 differ; does not say why",
    ("qkv_projection", 8): "fact: one factor 0.5 for the whole output",
    ("qkv_projection", 9): "fact: the axes in another order, [0, 1, 3, 2]",
    ("merge_heads", 5): "fact: the column permutation",
    ("merge_heads", 9): "only 'right number of entries, another shape'",
    ("merge_heads", 10): "fact: the column permutation",
    ("scaled_dot_product_attention", 7): "says sqrt(T_q) (q.shape[-2]); the answer used T_k",
    ("scaled_dot_product_attention", 9): "the check has no scores large enough to overflow",
    ("scaled_dot_product_attention", 12): "fact: each row off by its own factor",
    ("scaled_scores", 8): "fact: one factor 1.414 for the whole output",
    ("scaled_scores", 10): "every d_k in the check is a perfect square",
    ("scaled_scores", 11): "says 'divided by d_k', which is what scaling twice does",
    ("dot_product_std", 9): "says 'std of the single products q_i * k_i'",
    ("dot_product_std", 11): "says 'averaged q_i * k_i over the features' (same value)",
    ("causal_mask", 8): "fact 'each row times a factor of its own' does not point at the last row",
    ("causal_mask", 9): "fact: axis -1 reversed",
    ("causal_mask", 11): "fact: every wrong entry above the diagonal",
    ("masked_softmax", 6): "names 'masked after the softmax and renormalised', the same computation",
    ("masked_softmax", 10): "the check's scores are all float32",
    ("prefix_lm_mask", 5): "fact: transposed",
    ("prefix_lm_mask", 7): "fact: every wrong entry on the diagonal",
    ("prefix_lm_mask", 8): "fact: every wrong entry above the diagonal",
    ("prefix_lm_mask", 11): "fact: every wrong entry below the diagonal",
    ("packed_causal_mask", 4): "fact: transposed",
    ("packed_causal_mask", 10): "fact: every wrong entry on the diagonal",
    ("packed_causal_mask", 11): "fact: one diagonal entry, at [0, 0]",
    ("find_mask_leaks", 3): "hint: keep pairs with allowed[i, j] False",
    ("find_mask_leaks", 4): "says 'found no leaks' and to compare whole rows; not the 1e-9 step",
    ("find_mask_leaks", 5): "blames a zeros base input; the answer's tolerance is too loose",
    ("find_mask_leaks", 8): "lists the missing pairs, no pattern named",
    ("find_mask_leaks", 9): "says 'reported every disallowed pair without testing it'",
    ("find_mask_leaks", 10): "lists the missing pairs (all on the diagonal), no pattern named",
    ("find_mask_leaks", 12): "says 'reported every disallowed pair without testing it'",
    ("softmax_jacobian", 11): "fact 'wrong entries on the diagonal' does not point at precision",
    ("attention_backward", 9): "fact: nonzero gradient where keys lie above the diagonal",
    ("ring_buffer_decode_step", 6): "says it wrote into slot (t + 1) % W; the buffers it returns "
                                    "have the token in slot t % W",
    ("ring_buffer_decode_step", 9): "only 'right on an earlier case, not on this one'",
    ("training_memory", 13): "says 'one P per query head, not per kv head'; the answer has H but "
                             "adds it once instead of per layer",
    ("training_memory", 15): "the mutation of the frozen cfg is not noticed; only a weights mismatch",
    ("training_memory", 16): "the mutation of the frozen cfg is not noticed; only a weights mismatch",
    ("online_softmax", 9): "'rows do not sum to 1 over the keys' does not point at the final max",
    ("online_softmax", 10): "'rows do not sum to 1 over the keys'; which axis was summed is not said",
    ("flash_attention_tiled", 12): "fact: the last row of each tile is right; not 'mask the diagonal "
                                   "tile'",
    ("flash_attention_triton_backward", 4): "a causal checklist (the same text for 4, 6 and 9), "
                                            "which includes this mistake",
    ("flash_attention_triton_backward", 6): "the causal checklist, which includes this mistake",
    ("flash_attention_triton_backward", 9): "the causal checklist, which includes this mistake",
    ("llama3_rope_frequencies", 4): "its hint names swapped thresholds among the causes",
    ("llama3_rope_frequencies", 12): "only 'right on earlier cases, not on this one'",
    ("k_composition_score", 13): "names the product ||w_ov @ w_qk|| (as Q-composition)",
    ("gather_paged_kv", 1): "the check's exact-multiple case has a valid id in its padding",
    ("gather_paged_kv", 6): "fact: one position of axis 1 right; not what to change",
    ("gather_paged_kv", 7): "fact: positions 0..3 right (the first block); not what to change",
    ("merge_partials", 2): "tells to add a last axis to the weights; the max was over the wrong axis",
    ("merge_partials", 5): "a fact about keys below the diagonal, on the lse of a merge",
    ("merge_partials", 12): "no case has rows whose lses lie far apart",
    ("blocks_in_use", 1): "fact: exactly 2 times the expected; not what to change",
    ("blocks_in_use", 8): "says it copied a full shared block; the answer takes one block too many "
                          "at exact multiples",
    ("blocks_in_use", 11): "says the copy kept the original's reference; the child started empty",
    ("paged_decode_triton", 2): "fact 'each row off by its own factor' (rows are zeros)",
    ("paged_decode_triton", 7): "says 'the chunks or their merge are wrong' (n_splits=1 right)",
}

_CLASS = {"n": "named", "g": "generic", "w": "wrong-cause", "a": "accepted"}


def _build(codes_by_exercise, notes):
    from tests.learner_wrong.baseline import MODULES

    judged = {}
    for name in MODULES:
        try:
            mod = importlib.import_module(f"tests.learner_wrong.{name}")
        except ImportError:
            continue
        for ex, wrongs in mod.WRONG.items():
            codes = codes_by_exercise.get(ex, "")
            judged[ex] = {}
            for i, (desc, _) in enumerate(wrongs, 1):
                code = codes[i - 1] if i <= len(codes) else "?"
                judged[ex][desc] = (_CLASS.get(code, "unjudged"), notes.get((ex, i), ""))
    return judged


# After issue 32's diagnosis (AFTER.md, after.json): the same answers, judged the same way.
CODES_AFTER: dict[str, str] = {
    "qkv_projection": "nnnnnnnnnnnn",
    "merge_heads": "nnnnnnnnnnnn",
    "scaled_dot_product_attention": "nnnnnnnnnnnn",
    "scaled_scores": "nnnnnnnnnnnn",
    "attention_entropy": "nnnnnnnnnnnn",
    "dot_product_std": "nnnnnnnnnnnnn",
    "causal_mask": "nnnnnnnnnnn",
    "padding_mask": "nnnnnnnnnnnn",
    "masked_softmax": "nnnnnnnnnnnn",
    "prefix_lm_mask": "nnnnnnnnnnn",
    "packed_causal_mask": "nnnnnnnnnnnnn",
    "find_mask_leaks": "nnnnnnnnnnnn",
    "softmax_jacobian": "nnnnnnnnnnnn",
    "softmax_backward": "nnnnnnnnnnnn",
    "attention_backward": "nnnnnnnnnnnnn",
    "ring_buffer_decode_step": "nnnnnnnnnnnnnn",
    "training_memory": "nnnnnnnnnnnnnnnn",
    "online_softmax": "nnnnnnnnnnnnn",
    "flash_attention_tiled": "nnnnnnnnnnnnnn",
    "flash_attention_triton": "nnnnnnnnnnnnn",
    "flash_attention_triton_backward": "nnnnnnnnnnnnn",
    "llama3_rope_frequencies": "nnnnnnnnnnnnnn",
    "k_composition_score": "nnnnnnnnnnnnnn",
    "gather_paged_kv": "nnnnnnnnnnnnn",
    "merge_partials": "nnnnnnnnnnnnn",
    "blocks_in_use": "nnnnnnnnnnnnnn",
    "paged_decode_triton": "nnnnnnnnnnnnn",
}
NOTES_AFTER: dict[tuple[str, int], str] = {
    ("merge_heads", 9): "fact: the expected values in the expected order, in another shape: reshape",
    ("softmax_jacobian", 11): "fact: right to 3 digits, errors of both signs, the size of float16 rounding",
}

JUDGED = _build(CODES, NOTES)
JUDGED_AFTER = _build(CODES_AFTER, NOTES_AFTER)
