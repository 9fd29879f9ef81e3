"""The Llama-family decoder: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Packed tokens in, hidden states out: the forward takes ``input_ids: [T]``, ``positions:
[T]`` and one :class:`AttentionMetadata` for the whole step, so prefills of any length and
decodes share one code path, with no padding and no per-token Python loop. q/k/v and
gate/up are fused at load time into one matmul each. Numerics follow Hugging Face's
implementation (RMSNorm in fp32, RoPE angles in fp32) so greedy tokens match it.

On CUDA with the Triton backend the norms, RoPE and SiLU-and-mul run as one fused kernel
each (``kernels/fused.py``, same rounding) and the residual stream is carried beside the
hidden states, vLLM-style, so each residual add rides in the next norm. The torch code
stays the CPU path and the reference. Triton is imported only when a fused kernel first
runs (the interpreter must be switched on before that, see ``tests/kernels/conftest.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.attention import AttentionMetadata, LayerKV, attend, write_kv

KVCache = LayerKV
log = logging.getLogger(__name__)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# transformers' per-architecture defaults for keys a config.json leaves out (the generic
# fallbacks below are Llama's): a Qwen3 config without head_dim has 128-wide heads, not
# hidden_size / heads, and a Mistral one serves 128k positions, not 2048.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # normalised: has "rope_type"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_dtype: str | None = None  # the config's ``dtype`` / ``torch_dtype``

    @property
    def context_len(self) -> int:
        """The longest sequence served: attention here is full, so a sliding-window model
        is served up to its window, where full and windowed attention agree."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a ``config.json`` (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
        try:
            return cls._from_hf(cfg)
        except KeyError as exc:  # a bare KeyError read as "config.json: 'intermediate_size'"
            raise ValueError(f"lacks the required key {exc.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg["model_type"]
        cfg = {**_ARCH_DEFAULTS.get(model_type, {}), **cfg}
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: the same
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 4.x ``rope_scaling`` wins over 5.x ``rope_parameters``, as there.
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        rope["rope_type"] = rope_type
        needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
        missing = [k for k in needs.get(rope_type, ()) if k not in rope]
        if missing:
            raise ValueError(
                f"rope type {rope_type!r} needs {', '.join(missing)} in its parameters"
            )
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        if rope_type == "llama3":
            # The pre-scaling length, where transformers reads it for these architectures:
            # in the rope parameters, else max_position_embeddings. A top-level key (Phi-3's
            # place for it) is not read: taking it first gave other frequencies than theirs.
            rope["original_max_position_embeddings"] = int(
                rope.get("original_max_position_embeddings") or max_positions
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Read where transformers reads them: Llama both keys, Qwen3 attention_bias only;
        # Mistral has no bias, Qwen2 q/k/v biases whatever the config says and none on
        # o_proj, and neither Qwen's MLP has one.
        attention_bias = model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias"))
        mlp_bias = model_type == "llama" and bool(cfg.get("mlp_bias"))
        qwen2 = model_type == "qwen2"
        # transformers' defaults where the key is absent: Mistral windows at 4096; Qwen2/3
        # only with use_sliding_window, in the layers ``layer_types`` names "sliding_attention"
        # or, without that list, from max_window_layers on. Llama's attention never reads
        # the key (a Mistral converted to Llama keeps it): full attention there.
        window = None
        if model_type in ("mistral", "qwen2", "qwen3"):
            window = cfg.get("sliding_window", 4096)
        if model_type in ("qwen2", "qwen3"):
            layer_types = cfg.get("layer_types")
            windowed = (
                "sliding_attention" in layer_types
                if isinstance(layer_types, list)
                else cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"]
            )
            if not (cfg.get("use_sliding_window", False) and windowed):
                window = None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32 on the CPU, with ``linear`` or ``llama3``
    scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim)
    )
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by the factor, short ones kept, the middle blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class Linear(nn.Module):
    """``y = x W^T + b`` whose parameters start uninitialised (the loader fills them)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` in one kernel; with ``residual``, of ``residual += x`` (in place)."""
        from workers.engine.kernels import fused

        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        use_fused: bool = False,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if use_fused:
            from workers.engine.kernels import fused

            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm.fused(q), self.k_norm.fused(k)
            fused.rope_(q, k, cos, sin)  # in place on the qkv output
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        write_kv(self.backend, k, v, kv_cache, meta)
        out = attend(self.backend, q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, use_fused: bool = False) -> torch.Tensor:
        if use_fused:
            from workers.engine.kernels import fused

            return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on the fused kernels, with the residual stream carried apart:
        takes and returns ``(delta, residual)``, whose sum is the torch path's ``x``; the
        first layer gets the embeddings as ``x`` and ``residual=None``."""
        if residual is None:
            residual = x
            h = self.input_layernorm.fused(x)
        else:
            h = self.input_layernorm.fused(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, use_fused=True)
        h = self.post_attention_layernorm.fused(h, residual)
        return self.mlp(h, use_fused=True), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. Build it under ``torch.device(...)`` and a default
    dtype, then fill it with :meth:`load_weights` (or the loader's dummy init)."""

    def __init__(
        self, cfg: ModelConfig, backend: str = "torch", fused_ops: bool | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        # None: the fused kernels run when the triton backend runs on CUDA (tests force True
        # to run them in the Triton interpreter).
        self.fused_ops = fused_ops
        self.model = LlamaModel(cfg, backend)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        )
        self.inv_freq: torch.Tensor
        # Computed on the CPU (on the meta device, torch's reference ops import Triton),
        # then placed where the module is being built.
        inv_freq = rope_inv_freq(cfg).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed tokens (K/V go into ``kv_caches``)."""
        x = F.embedding(input_ids, self.model.embed_tokens)
        # Angles in fp32, then cast, exactly as transformers does.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        if not self.use_fused(x):
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, kv_cache, meta)
            return self.model.norm(x)
        residual = None
        layers = cast(Iterable[DecoderLayer], self.model.layers)
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            x, residual = layer.forward_fused(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm.fused(x, residual)

    def use_fused(self, x: torch.Tensor) -> bool:
        """Whether this forward runs the fused Triton kernels (see ``fused_ops``)."""
        if self.fused_ops is not None:
            return self.fused_ops
        return self.backend == "triton" and x.is_cuda

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the given hidden states (only rows that sample), in the
        model's dtype: the sampler widens them where it needs fp32 (the fused sampling kernel
        reads them as they are, saving a ``[N, vocab]`` fp32 copy per step)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up; raise naming any tensor
        the checkpoint lacks or has in a shape this config does not expect."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        expected: dict[str, int] = {}  # param name -> rows still to fill
        for name, p in params.items():
            expected[name] = p.shape[0]
        tied_head: torch.Tensor | None = None  # a tied config's lm_head.weight, if any
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if not hf_name.startswith(("model.", "lm_head.")):
                hf_name = "model." + hf_name  # saved from the bare LlamaModel
            name = hf_name.replace("model.embed_tokens.weight", "model.embed_tokens")
            name = "lm_head" if name == "lm_head.weight" else name
            if name == "lm_head" and self.lm_head is None:
                tied_head = tensor  # tied: a copy, or a head of its own (see below)
                continue
            parts = name.split(".")
            start, rows = 0, None
            if len(parts) >= 2 and parts[-2] in fused:
                target, start, rows = fused[parts[-2]]
                parts[-2] = target
                name = ".".join(parts)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {cfg.model_type}")
            param = params[name]
            dest = param.data if rows is None else param.data[start : start + rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            expected[name] -= dest.shape[0]
        if tied_head is not None:
            self._settle_tied_head(tied_head, expected)
        missing = sorted(n for n, left in expected.items() if left > 0)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")

    def _settle_tied_head(self, head: torch.Tensor, expected: dict[str, int]) -> None:
        """A tied config whose checkpoint has ``lm_head.weight``, as transformers 5 reads it:
        the embedding's copy is dropped; with no embedding it fills it; a head that differs
        (a fine-tune trained untied, its config left tied) is kept as the head: tying would
        silently give other tokens."""
        embed = self.model.embed_tokens
        if tuple(head.shape) != tuple(embed.shape):
            raise ValueError(
                f"checkpoint tensor 'lm_head.weight' has shape {tuple(head.shape)}, "
                f"expected {tuple(embed.shape)}"
            )
        if expected.get("model.embed_tokens", 0) > 0:
            embed.data.copy_(head)
            expected["model.embed_tokens"] = 0
        elif not torch.equal(embed.data, head.to(embed.dtype)):
            log.warning("tie_word_embeddings is set but the checkpoint's lm_head.weight differs "
                        "from its embedding: serving the checkpoint's head, as transformers 5 "
                        "does")  # fmt: skip
            self.lm_head = nn.Parameter(
                head.to(device=embed.device, dtype=embed.dtype), requires_grad=False
            )
