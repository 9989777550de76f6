"""The course's graded exercises: the one hand-kept list.

One line an exercise: its id ("3.2": notebook 03, second exercise), the function the learner writes
(its name is the check's, ``helpers.checks.<name>``, and the reference's, ``helpers.<module>.<name>``,
whose signature and docstring are the exercise's contract), a title, its stars (★ warm-up, ★★ core,
★★★ hard; one point a star), the notebook stem, the section of ``notebooks/<notebook>.ipynb`` it
builds on, whether it is a bonus (scored apart, never blocking a pass) and, where it is not
``nb<notebook>``, the module that holds its reference and its check.

Everything else that lists exercises comes from here or is checked against it: the checks'
registry (``@exercise`` reads its line), the README's table and the counts and ranges in the
notebooks' prose (``make sync`` writes them), the grader's list of what each notebook holds,
``tests/test_machinery.py``'s contract test, and ``make new-exercise``, which adds a line here.
This module imports nothing but the standard library: the grader reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One graded exercise (see the module's docstring for the fields)."""

    id: str
    name: str
    title: str
    stars: int
    notebook: str
    section: str | None = None
    bonus: bool = False
    module: str = ""  # the lesson module and the check module, when not "nb" + notebook

    @property
    def points(self) -> int:
        """One point a star."""
        return self.stars

    @property
    def order(self) -> tuple[int, ...]:
        """The exercise's place in the course, to sort by: "10.3" -> (10, 3)."""
        return tuple(int(part) for part in self.id.split("."))

    @property
    def module_name(self) -> str:
        """The module (in ``helpers`` and in ``helpers.checks``) that holds the reference and the check."""
        return self.module or f"nb{self.notebook}"

    @property
    def pointer(self) -> str:
        """Where to revisit: ``notebooks/05_multihead.ipynb, section 3. Why W_O exists``."""
        where = f"notebooks/{self.notebook}.ipynb"
        return f"{where}, section {self.section}" if self.section else where


EXERCISES: tuple[Exercise, ...] = (
    Exercise("1.1", "qkv_projection", "Q/K/V projection and head split", 1, "01_qkv_shapes",
             "2. The seven steps, with every shape"),
    Exercise("1.2", "merge_heads", "merge heads back to [B, T, D]", 1, "01_qkv_shapes",
             "2. The seven steps, with every shape"),
    Exercise("1.3", "scaled_dot_product_attention", "scaled dot-product attention", 1, "01_qkv_shapes",
             "1. What queries, keys and values are for"),

    Exercise("2.1", "scaled_scores", "scaled scores", 1, "02_scaling",
             "1. The variance argument"),
    Exercise("2.2", "attention_entropy", "attention entropy", 1, "02_scaling",
             "2. What the scale does to the softmax: entropy and peak weight"),
    Exercise("2.3", "dot_product_std", "empirical std of q·k", 2, "02_scaling",
             "1. The variance argument"),

    Exercise("3.1", "causal_mask", "causal mask", 1, "03_masks",
             "1. A mask is a yes/no table"),
    Exercise("3.2", "padding_mask", "padding mask", 2, "03_masks",
             "2.1 Padding: a mask on keys, shaped to broadcast"),
    Exercise("3.3", "masked_softmax", "masked softmax", 2, "03_masks",
             "4.4 A row with nothing allowed: NaN, and how it spreads"),
    Exercise("3.4", "prefix_lm_mask", "prefix-LM mask", 2, "03_masks",
             "2.2 Prefix-LM: a bidirectional prefix, then causal"),
    Exercise("3.5", "packed_causal_mask", "packed (block-diagonal causal) mask", 2, "03_masks",
             "2.3 Packed sequences: block-diagonal causal (varlen)"),
    Exercise("3.6", "find_mask_leaks", "find mask leaks by perturbation", 3, "03_masks",
             "5. Mask tests: perturb and watch"),

    Exercise("4.1", "softmax_jacobian", "the softmax Jacobian", 1, "04_backward",
             "1. The softmax Jacobian"),
    Exercise("4.2", "softmax_backward", "softmax backward without the Jacobian", 2, "04_backward",
             "2. Backward through softmax without the Jacobian"),
    Exercise("4.3", "attention_backward", "attention backward by hand", 3, "04_backward",
             "4. One attention head, backward by hand"),

    Exercise("5.1", "multi_head_attention", "multi-head attention from plain matrices", 2, "05_multihead",
             "1. Multi-head attention from plain matrices"),
    Exercise("5.2", "mha_param_count", "parameters of a multi-head attention layer", 1, "05_multihead",
             "3. Parameters and FLOPs"),
    Exercise("5.3", "ablate_head", "head ablation", 2, "05_multihead",
             "6. Heads as diagnostics"),

    Exercise("6.1", "repeat_kv", "repeat the key/value heads", 1, "06_kv_sharing",
             "2. repeat_kv, SDPA and the Triton kernel"),
    Exercise("6.2", "grouped_query_attention", "grouped-query attention", 2, "06_kv_sharing",
             "2. repeat_kv, SDPA and the Triton kernel"),
    Exercise("6.3", "kv_values_per_token", "cached values per token per layer", 1, "06_kv_sharing",
             "3. What a token costs in the cache"),
    Exercise("6.4", "mla_absorbed_scores", "MLA scores against the latent (absorbed W_UK)", 3, "06_kv_sharing",
             "6.3 Absorption"),

    Exercise("7.1", "kv_cache_bytes", "bytes of a KV cache", 1, "07_kv_cache",
             "5. How big the cache gets"),
    Exercise("7.2", "decode_step", "one decode step with a KV cache", 3, "07_kv_cache",
             "2. One decode step"),
    Exercise("7.3", "prefill_decode_flops", "prefill and decode FLOPs", 2, "07_kv_cache",
             "6. Prefill and decode, measured"),
    Exercise("7.4", "ring_buffer_decode_step", "a ring-buffer cache for a sliding window", 3, "07_kv_cache",
             "9. Sliding windows: a ring-buffer cache"),

    Exercise("8.1", "attention_flops", "FLOPs of one attention layer", 2, "08_flops_memory",
             "2. One attention layer, part by part"),
    Exercise("8.2", "score_matrix_bytes", "bytes of the score matrix", 1, "08_flops_memory",
             "6. The memory of the scores"),
    Exercise("8.3", "max_seq_len_for_scores", "longest context whose scores fit", 2, "08_flops_memory",
             "7. The longest context that fits"),
    Exercise("8.4", "training_memory", "the memory of a training step", 2, "08_flops_memory",
             "10. The memory of a training step"),

    Exercise("9.1", "online_softmax", "online softmax", 2, "09_flash_attention",
             "2. The online softmax"),
    Exercise("9.2", "flash_attention_tiled", "tiled FlashAttention in PyTorch", 3, "09_flash_attention",
             "3. Tiled attention in PyTorch"),
    Exercise("9.3", "flash_attention_triton", "FlashAttention forward in Triton", 3, "09_flash_attention",
             "4. The Triton kernel, block by block", module="nb09_triton_flash"),
    Exercise("9.4", "flash_attention_triton_backward", "FlashAttention backward in Triton", 3, "09_flash_attention",
             "5. The backward pass", bonus=True, module="nb09_triton_flash"),

    Exercise("10.1", "rope", "RoPE, rotate-half convention", 2, "10_positions",
             "3. RoPE from its definition"),
    Exercise("10.2", "alibi_bias", "ALiBi bias", 2, "10_positions",
             "7. ALiBi: a bias instead of a rotation"),
    Exercise("10.3", "llama3_rope_frequencies", "Llama 3's RoPE scaling", 2, "10_positions",
             "9. Longer contexts: rescaling the RoPE frequencies"),

    Exercise("11.1", "swiglu", "SwiGLU MLP", 1, "11_trained_transformer",
             "1. The MLP around attention"),
    Exercise("11.2", "causal_lm_loss", "causal language-model loss", 1, "11_trained_transformer",
             "2. The pretraining loss"),
    Exercise("11.3", "induction_scores", "induction scores", 3, "11_trained_transformer",
             "5. Reading the trained heads"),
    Exercise("11.4", "k_composition_score", "K-composition score", 2, "11_trained_transformer",
             "7. Circuits in the logits and the weights"),

    Exercise("12.1", "gather_paged_kv", "read a sequence from a paged cache", 2, "12_serving",
             "3. A paged cache"),
    Exercise("12.2", "merge_partials", "merge partial softmax results", 2, "12_serving",
             "4. Merging partial results"),
    Exercise("12.3", "blocks_in_use", "count the blocks of a paged cache", 3, "12_serving",
             "3. A paged cache"),
    Exercise("12.4", "paged_decode_triton", "split-KV decoding over a paged cache in Triton", 3, "12_serving",
             "4. Merging partial results", bonus=True, module="nb12_triton_decode"),

    Exercise("13.1", "zigzag_positions", "the positions a rank holds in the zigzag layout", 1, "13_across_devices",
             "4. Ring attention"),
    Exercise("13.2", "ring_attention", "ring attention forward, returning the log-sum-exp", 3, "13_across_devices",
             "4. Ring attention"),
    Exercise("13.3", "ulysses_attention", "Ulysses with GQA", 2, "13_across_devices",
             "3. Ulysses"),
    Exercise("13.4", "comm_bytes_per_rank", "bytes each rank sends", 2, "13_across_devices",
             "6. The cost model"),
)


def by_name() -> dict[str, Exercise]:
    """Function name -> exercise, in course order."""
    return {e.name: e for e in sorted(EXERCISES, key=lambda e: e.order)}


def lookup(name: str) -> Exercise:
    """The exercise whose function is ``name``, or an error that says where to add it."""
    found = by_name().get(name)
    if found is None:
        raise LookupError(f"no exercise named {name!r} in helpers/registry.py: add its line there "
                          "(`make new-exercise NB=.. NAME=..` writes it)")
    return found


def find(wanted: str) -> Exercise | None:
    """The exercise whose id ("3.7") or function name is ``wanted``, or None."""
    return next((e for e in EXERCISES if wanted in (e.id, e.name)), None)


def by_notebook() -> dict[str, list[Exercise]]:
    """Notebook stem -> its exercises in course order, notebooks in order."""
    out: dict[str, list[Exercise]] = {}
    for e in sorted(EXERCISES, key=lambda e: e.order):
        out.setdefault(e.notebook, []).append(e)
    return dict(sorted(out.items()))


def in_module(module: str) -> list[str]:
    """The names of the exercises whose reference and check live in ``module`` ("nb03_masks", or a
    dotted name ending in it), in course order."""
    short = module.rsplit(".", 1)[-1]
    return [e.name for e in sorted(EXERCISES, key=lambda e: e.order) if e.module_name == short]
