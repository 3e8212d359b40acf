"""Engine configuration: one dataclass, validated once.

Every field carries its help text in `field(metadata=...)`; `genpool worker` and `LLM(...)` take
their engine options from these fields (engine/config_args.py), so a new field is an option at once.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from genpool.schemas import settings

# names -> torch dtype attribute; torch is imported only where a dtype object is needed, so the CLI
# can build its options from this module cheaply
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
KV_CACHE_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "int8")
_KV_NAMES = {**DTYPES, "int8": "int8"}  # int8: kernels/kvq.py's rows (an fp32 scale per group of 32)
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
KERNEL_BACKENDS = settings.KERNEL_BACKENDS  # "auto", "cpu", "torch", "triton"
QUANT_COMPUTE = settings.QUANT_COMPUTE  # "auto", "amx", "vnni", "bf16", "fp32"
# Fields with a row in schemas/settings.py default to None, "not given": __post_init__ fills them
# from their environment variable, else the row's default (explicit > env > default), and
# records where each came from in `setting_sources` (the worker's start line prints it).
KERNEL_FIELDS = ("kernel_backend", "cpu_gemm", "quant_compute", "huge_pages", "malloc_tune")

QUANTIZATIONS = ("int8", "gguf", "awq")  # engine/models/quant.py loads each

def _opt(help: str, **extra) -> dict:
    return {"help": help, **extra}


def usable_cores() -> int:
    """The cores this process may run on: taskset and cpusets count, as os.cpu_count() does not."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class EngineConfig:
    model: str = field(metadata=_opt("registry name (e.g. smollm2-135m; `genpool models list`) or local HF "
                                     "checkpoint dir (required, no default)"))
    dtype: str = field(default="float32", metadata=_opt("weights and activations dtype", choices=tuple(DTYPES)))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "KV cache dtype: auto (the model's --dtype), or under a float32 model on the CPU bfloat16 (twice "
        "the tokens in the same memory, half the bytes decode attention reads; K/V rounded to bf16 when "
        "written) or int8 (3.56x the tokens at head size 64: K/V quantized when written, an fp32 "
        "scale per group of 32); attention computes in fp32", choices=KV_CACHE_DTYPES))
    device: str = field(default="auto", metadata=_opt(
        "auto|cpu|cuda|cuda:N (auto: CUDA when torch sees a GPU, else the CPU)"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV-cache block (a power of two)"))
    max_num_seqs: int = field(default=64, metadata=_opt("sequences in one batch at most"))
    max_num_batched_tokens: int = field(default=1024, metadata=_opt(
        "tokens per step at most (prefill chunks + decodes share it)"))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "reuse the KV blocks of identical prompt prefixes", off_aliases=("--no-prefix-caching",)))
    num_kv_blocks: int | None = field(default=None, metadata=_opt(
        "KV-cache blocks (default: from --kv-cache-memory on the CPU, --gpu-memory-utilization on CUDA)"))
    kv_cache_memory: int | None = field(default=None, metadata=_opt(
        "bytes of K/V on the CPU when --num-kv-blocks is not given (default: the model's need, "
        "max_num_seqs full contexts, at most a quarter of the available memory and 2 GiB)"))
    gpu_memory_utilization: float = field(default=0.85, metadata=_opt(
        "fraction of GPU memory for weights + KV on CUDA when --num-kv-blocks is not given"))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "tokens per sequence at most (default: the model's max_position_embeddings)"))
    kernel_backend: str | None = field(default=None, metadata=_opt(
        "auto: triton on CUDA, cpu (C kernels) on the CPU when a C compiler is present, else torch",
        choices=KERNEL_BACKENDS))
    cpu_gemm: bool | None = field(default=None, metadata=_opt(
        "fp32 linear layers and prefill attention on genpool's C tile kernels (--no-cpu-gemm: "
        "torch's GEMM and SDPA)"))
    quant_compute: str | None = field(default=None, metadata=_opt(
        "how quantized products compute on the CPU: auto (vnni where the CPU has it, else bf16 on "
        "bf16 hardware, else fp32) or one of those (a mode the CPU lacks falls back down the list)",
        choices=QUANT_COMPUTE))
    huge_pages: bool | None = field(default=None, metadata=_opt(
        "packed CPU weights in huge-page memory (MADV_HUGEPAGE)"))
    malloc_tune: bool | None = field(default=None, metadata=_opt(
        "raise glibc's mmap threshold and stop heap trimming on the CPU, so activation buffers are reused"))
    num_threads: int | None = field(default=None, metadata=_opt(
        "threads of the CPU kernels' pool and torch's ops (default: every core this process may "
        "run on: taskset and cpusets count)"))
    quantization: str | None = field(default=None, metadata=_opt(
        "int8: quantize the weights at load (per output channel); gguf: load the model's GGUF file "
        "natively (Q8_0/Q4_0/Q4_1); awq: an AWQ checkpoint (detected from config.json) (default: "
        "none: the checkpoint's weights as they are, in --dtype; an AWQ checkpoint is still detected)",
        choices=QUANTIZATIONS))
    seed: int = field(default=0, metadata=_opt("seed of the stream unseeded sampled requests draw their seeds from"))
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "split the model over this many ranks (Megatron-style; CPU: processes on gloo, CUDA: one "
        "GPU each on NCCL); num_threads is shared out among them"))
    grammar_compile_timeout_s: float = field(default=30.0, metadata=_opt(
        "seconds a structured-output grammar may take to compile before its job fails"))
    speculative_method: str | None = field(default=None, metadata=_opt(
        "ngram: speculative decoding, exact, with drafts looked up in each sequence's own tokens "
        "(vLLM's prompt lookup; engine/speculative.py) (default: none: only jobs that ask "
        "(speculative=true) draft, with the settings below)", choices=("ngram",)))
    num_speculative_tokens: int = field(default=4, metadata=_opt("tokens one draft proposes at most"))
    prompt_lookup_min: int = field(default=2, metadata=_opt("shortest suffix n-gram a draft looks up"))
    prompt_lookup_max: int = field(default=4, metadata=_opt("longest suffix n-gram a draft looks up"))
    speculative_max_batch: int = field(default=4, metadata=_opt(
        "no drafts while more sequences than this run (vLLM's disable_by_batch_size): there the "
        "draft rows cost more than they save (measured on 2 cores: batch 4 1.22x, batch 8 0.90x)"))
    # {field: "explicit" | "env GENPOOL_X" | "default"} for KERNEL_FIELDS; filled by __post_init__
    # (given only by dataclasses.replace / asdict round trips, which keep the sources)
    setting_sources: dict = field(default_factory=dict, compare=False, repr=False,
                                  metadata={"cli": False})

    def __post_init__(self):
        self.setting_sources = settings.resolve_fields(self, "EngineConfig", self.setting_sources)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        kv, model = self.kv_dtype_name, DTYPES[self.dtype]
        if kv != model and (kv, model) not in (("bfloat16", "float32"), ("int8", "float32")):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} under dtype {self.dtype!r}: the KV cache "
                             "is the model's dtype, or bfloat16 or int8 under a float32 model")
        if not DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.quant_compute not in QUANT_COMPUTE:
            raise ValueError(f"quant_compute must be one of {QUANT_COMPUTE}, got {self.quant_compute!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if str(self.model).lower().endswith(".gguf"):  # a local GGUF file: its weights as stored
            if self.quantization not in (None, "gguf"):
                raise ValueError(f"{self.model} is a GGUF file: its weights load natively as stored; "
                                 f"quantization {self.quantization!r} cannot apply to them")
            self.quantization = "gguf"
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError("quantized weights are not supported with tensor_parallel_size > 1 yet: "
                             "drop --quantization or use --tensor-parallel-size 1")
        if self.speculative_method not in (None, "ngram"):
            raise ValueError(f"speculative_method must be ngram or none, got {self.speculative_method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "speculative_max_batch"):
            value = getattr(self, name)  # a float or a string here would fail every step, not this call
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch (disable_by_batch_size) must be >= 1, got "
                             f"{self.speculative_max_batch}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max or self.num_speculative_tokens < 1:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max and "
                             f"num_speculative_tokens >= 1, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}, {self.num_speculative_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's canonical dtype name ("auto": the model's)."""
        return DTYPES[self.dtype] if self.kv_cache_dtype == "auto" else _KV_NAMES[self.kv_cache_dtype]

    @property
    def kv_torch_dtype(self):
        import torch

        return getattr(torch, self.kv_dtype_name)

    def settings_report(self) -> str:
        """Each environment-backed setting, its value and where it came from, for a start line:
        `kernel_backend=auto (default), cpu_gemm=False (env GENPOOL_CPU_GEMM), ...`."""
        return settings.report(self, self.setting_sources, KERNEL_FIELDS)

    def kernel_settings(self):
        """The kernels' process-wide settings this config asks for (kernels/settings.py)."""
        from genpool.kernels.settings import KernelSettings

        return KernelSettings(cpu_gemm=self.cpu_gemm, quant_compute=self.quant_compute,
                              huge_pages=self.huge_pages)

    def spec_config(self):
        """The speculative decoding settings (engine/speculative.py): every job drafts by default
        under a method; without one, only the jobs that ask (speculative=true), with these settings."""
        from genpool.engine.speculative import SpecConfig

        return SpecConfig(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max,
                          self.speculative_max_batch, default_on=self.speculative_method is not None)

    def resolved_device(self) -> str:
        """The device the engine runs on: "auto" becomes "cuda" when torch sees a GPU, else "cpu"."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def apply_kernel_settings(config: EngineConfig) -> None:
    """At engine start, once: the kernels read `config`'s settings from now on (kernel functions
    have no config at hand; kernels/settings.py). malloc_tune goes to tune_malloc() itself."""
    from genpool.kernels.settings import set_kernel_settings

    set_kernel_settings(config.kernel_settings())
