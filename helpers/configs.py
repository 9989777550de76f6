"""Sizes of real models, one definition for every notebook that counts parameters, FLOPs or bytes.

Each entry is a published configuration (the model's ``config.json`` or paper; the source is named
in ``source``). Only the sizes that attention and its memory depend on are kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Attention-relevant sizes of one model.

    ``d_model`` D, ``n_layers`` L, ``n_heads`` H, ``n_kv_heads`` H_kv, ``head_dim`` d_h,
    ``d_ff`` the (dense) MLP width, ``kind`` one of "mha", "gqa", "mqa", "mla". For MLA,
    ``kv_lora_rank`` d_c and ``rope_dim`` d_r are what the cache holds per token per layer.

    Interleaved local/global attention (Llama 4): ``attention_chunk_size`` > 0 means that every
    layer except each ``full_attention_interval``-th one attends only within its chunk of that many
    tokens (so it caches at most that many); the others attend to the whole context.
    """

    name: str
    kind: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    source: str
    kv_lora_rank: int = 0
    rope_dim: int = 0
    attention_chunk_size: int = 0
    full_attention_interval: int = 0

    @property
    def full_attention_layers(self) -> int:
        """Layers that attend to the whole context (all of them unless attention is chunked)."""
        if not self.attention_chunk_size:
            return self.n_layers
        return self.n_layers // self.full_attention_interval

    def cached_tokens(self, seq_len: int) -> int:
        """Token-layers the K/V cache holds after ``seq_len`` tokens, summed over layers:
        ``L * T`` with full attention everywhere; ``L_full * T + L_chunked * min(T, chunk)`` when
        most layers attend within chunks (a chunked layer keeps at most one chunk)."""
        chunked = self.n_layers - self.full_attention_layers
        return self.full_attention_layers * seq_len + chunked * min(seq_len, self.attention_chunk_size)


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in [
        ModelConfig("Transformer (base)", "mha", 512, 6, 8, 8, 64, 2048, 37000,
                    "Vaswani et al. 2017, Table 3 (base model; shared BPE vocabulary of about 37,000)"),
        ModelConfig("GPT-2 small", "mha", 768, 12, 12, 12, 64, 3072, 50257, "GPT-2 config.json (gpt2)"),
        ModelConfig("Llama-3-8B", "gqa", 4096, 32, 32, 8, 128, 14336, 128256, "Meta-Llama-3-8B config.json"),
        ModelConfig("Llama-3-70B", "gqa", 8192, 80, 64, 8, 128, 28672, 128256, "Meta-Llama-3-70B config.json"),
        ModelConfig("Llama-4-Maverick", "gqa", 5120, 48, 40, 8, 128, 16384, 202048,
                    "Llama4TextConfig (hidden_size 5120, 40 heads, 8 KV heads, head_dim 128, 48 layers, "
                    "intermediate_size_mlp 16384 in the dense layers; attention_chunk_size 8192 and "
                    "no_rope_layers: every 4th layer attends to the whole context without RoPE, the other "
                    "36 within 8,192-token chunks)", attention_chunk_size=8192, full_attention_interval=4),
        ModelConfig("Qwen3-8B", "gqa", 4096, 36, 32, 8, 128, 12288, 151936, "Qwen3-8B config.json"),
        ModelConfig("Falcon-7B", "mqa", 4544, 32, 71, 1, 64, 18176, 65024, "Falcon-7B config.json (multi-query: one KV head)"),
        ModelConfig("Falcon-40B", "gqa", 8192, 60, 128, 8, 64, 32768, 65024,
                    "Falcon-40B config.json (n_head 128, n_head_kv 8: 'multigroup' attention, 8 KV heads for "
                    "tensor parallelism of degree 8; arXiv:2311.16867)"),
        ModelConfig("DeepSeek-V3", "mla", 7168, 61, 128, 128, 128, 18432, 129280,
                    "DeepSeek-V3 config (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, "
                    "v_head_dim 128; arXiv:2412.19437)", kv_lora_rank=512, rope_dim=64),
    ]
}


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU (never measured here: label them as datasheet figures).

    ``peak_flops`` dense bf16 tensor-core FLOP/s (a multiply-add counts 2), ``bandwidth`` HBM
    bytes/s, ``memory`` the bytes the device reports (what "fits" counts use),
    ``shared_per_sm`` and ``registers_per_sm`` bytes per SM. ``memory_label`` is the marketing
    size ("80 GB"), kept for labels and as a lower bound only.
    """

    name: str
    peak_flops: float
    bandwidth: float
    memory: int
    shared_per_sm: int
    registers_per_sm: int
    source: str
    memory_label: str = ""

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the roofline turns: peak_flops / bandwidth."""
        return self.peak_flops / self.bandwidth


H100_SXM = GPUSpec("H100 SXM", 989e12, 3.35e12, 81_559 * 2**20, 228 * 1024, 65_536 * 4,
                   "NVIDIA H100 datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, \"80 GB\"); the memory "
                   "is what an H100 80GB HBM3 reports, 81,559 MiB (85.5 x 10^9 bytes), in nvidia-smi and "
                   "torch.cuda.mem_get_info()'s total; each process's CUDA context then takes a few hundred "
                   "MiB of it, so the free memory an application sees is somewhat less; Hopper tuning guide "
                   "(up to 228 KB shared memory, 65,536 32-bit registers per SM)", memory_label="80 GB")
