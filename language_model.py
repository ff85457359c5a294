"""The language model of steps 6 to 8: a small Llama-style decoder, the text it learns, its bytes as tokens.

Copy it beside tensor_parallel.py, pipeline_parallel.py or nd_parallel.py (with fsdp_checkpoint.py); it imports only
torch. Its names and numbers are transformers' LlamaForCausalLM's (less "model."): hf_checkpoint.py exports it.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


@dataclass
class DecoderConfig:
    """The decoder's sizes. The defaults: 853,120 parameters, an epoch of the default text in 44 to 112 s, 2 cores."""
    vocab_size: int = 256  # bytes: encode()
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each key/value head serves n_heads // n_kv_heads query heads
    hidden: int = 384  # the SwiGLU MLP's width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048  # the longest sequence the rotary positions are meant for (Hugging Face's config wants it)
    n_experts: int = 0  # a mixture of this many SwiGLU experts in place of each MLP; 0: the dense MLP (Llama's)
    top_k: int = 2  # the experts each token goes to
    balance_weight: float = 0.01  # of the load-balancing loss, added to the gradients (MoE.forward)

    def hf_config(self):
        """The same model as transformers' LlamaConfig(**this)."""
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": self.vocab_size,
                "hidden_size": self.dim, "intermediate_size": self.hidden, "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
                "head_dim": self.dim // self.n_heads, "hidden_act": "silu", "rms_norm_eps": self.norm_eps,
                "max_position_embeddings": self.max_seq_len, "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}}

    @classmethod
    def from_hf(cls, c):
        """From a Llama config.json's fields; ValueError names what this decoder does not have."""
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 1e4)}
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        odd = {k: c[k] for k in ("tie_word_embeddings", "attention_bias", "mlp_bias") if c.get(k)}
        odd |= {k: v for k, v, ours in (("rope_type", rope.get("rope_type", "default"), "default"),
                                        ("hidden_act", c.get("hidden_act", "silu"), "silu"),
                                        ("head_dim", c.get("head_dim", head_dim), head_dim)) if v != ours}
        if odd:
            raise ValueError(f"this decoder has no {', '.join(f'{k}={v}' for k, v in odd.items())}")
        return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c.get("num_key_value_heads") or c["num_attention_heads"], c["intermediate_size"],
                   rope["rope_theta"], c["rms_norm_eps"], c.get("max_position_embeddings", 2048))


class RMSNorm(nn.Module):
    """x / rms(x), times a learned scale per feature (no mean subtracted, no bias), as in Llama."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(x, theta, positions=None):
    """Rotary positions (RoPE) of x [batch, heads, seq, head_dim], Hugging Face's layout: each feature of the first
    half turns with its partner in the second half, by an angle that grows with the position. positions: each
    token's place in the whole sequence (context parallelism's slice of it), default 0, 1, 2, ..."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=x.dtype) / half)
    positions = torch.arange(x.shape[-2], device=x.device) if positions is None else positions
    angles = positions.to(x.dtype)[:, None] * frequencies
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions. Heads are counted from the projections' outputs
    (view(..., -1, head_dim)): under tensor parallelism a rank's q_proj, k_proj and v_proj give its own heads.
    Context parallelism (nd_parallel.py) sets `positions` to its tokens' places and `context_parallel` to attention
    across the ranks' slices of the sequence."""

    def __init__(self, config):
        super().__init__()
        self.head_dim, self.theta = config.dim // config.n_heads, config.rope_theta
        self.q_proj = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.positions = self.context_parallel = None  # the whole sequence here

    def forward(self, x):
        batch, seq = x.shape[:2]
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotary(q, self.theta, self.positions), rotary(k, self.theta, self.positions)
        if self.context_parallel is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = self.context_parallel(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """n SwiGLU experts, their weights stacked [expert, out, in]. Under expert parallelism (nd_parallel.py) the
    weights are DTensors split over the experts: each rank runs its own experts on the tokens sent to them."""

    def __init__(self, n, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x, counts):
        """x: tokens grouped by expert, counts[e] of them for this module's expert e, in order."""
        weights = [w.to_local() if hasattr(w, "to_local") else w  # a DTensor: this rank's experts
                   for w in (self.gate_proj, self.up_proj, self.down_proj)]
        out = [F.linear(F.silu(F.linear(chunk, gate)) * F.linear(chunk, up), down)
               for chunk, gate, up, down in zip(x.split(counts.tolist()), *weights)]
        return torch.cat(out)


class BalanceLoss(torch.autograd.Function):
    """Returns x as it is; backward, adds the gradient of `loss` times `scale`: the load-balancing loss trains the
    router without travelling with the output (through a pipeline, say) to the training loss (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=grad.dtype, device=grad.device), None


class MoE(nn.Module):
    """A mixture of experts (top-k, dropless: every token reaches its k experts, however many choose one). The
    router scores each token for every expert; the token goes to its k best, and their outputs are summed with the
    scores as weights (renormalized over the k). A load-balancing loss (DeepSeek-V3's sequence-wise one: for each
    sequence, experts times the sum over experts of the fraction of its tokens each expert got times its mean
    score) pushes the router to spread the tokens. `dispatch` (expert parallelism) sends the tokens to the ranks
    that hold their experts and back; `sequence_group` (context parallelism) holds the rest of each sequence."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.balance_weight = config.top_k, config.balance_weight
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = GroupedExperts(config.n_experts, config.dim, config.hidden)
        self.dispatch = self.sequence_group = None
        self.balance_scale = None  # the loss's weight a sequence; None: the mean over this batch's sequences
        self.routed = torch.zeros(config.n_experts, dtype=torch.long)  # tokens each expert got, since reset
        self.counting = True

    def forward(self, x):
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores = self.router(tokens).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        experts = scores.shape[-1]
        counts = torch.bincount(chosen.flatten(), minlength=experts)
        if self.counting:
            self.routed += counts.cpu()
        order = chosen.flatten().argsort(stable=True)  # the (token, choice) pairs grouped by expert
        routed = tokens[order // self.top_k]
        out = self.experts(routed, counts) if self.dispatch is None else self.dispatch(self.experts, routed, counts)
        out = torch.zeros_like(tokens).index_add(0, order // self.top_k, out * weights.flatten()[order, None])
        # The balance loss of each sequence, from its counts (all of its tokens': context parallelism sums them).
        per_sequence = F.one_hot(chosen, experts).sum(1).view(batch, seq, experts).sum(1)
        if self.sequence_group is not None:
            torch.distributed.all_reduce(per_sequence, group=self.sequence_group)
            seq *= torch.distributed.get_world_size(self.sequence_group)
        fraction = per_sequence.to(x.dtype) * experts / (self.top_k * seq)  # 1 for each expert when balanced
        mean_score = scores.view(batch, -1, experts).sum(1) / seq  # of this rank's tokens: a part of the sum
        loss = self.balance_weight * (fraction * mean_score).sum()
        scale = 1 / batch if self.balance_scale is None else self.balance_scale
        return BalanceLoss.apply(out.view(batch, -1, dim), loss, scale)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MoE(config) if config.n_experts else SwiGLU(config.dim, config.hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A Llama-style decoder: token embeddings, layers of attention and MLP, a final norm and the output head.
    Its parameter names are those of transformers' LlamaForCausalLM without its "model." prefix (hf_name())."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, x):  # a pipeline stage sets the parts it does not own to None: names stay the full model's
        x = x if self.embed_tokens is None else self.embed_tokens(x)
        for layer in filter(None, self.layers):
            x = layer(x)
        return x if self.lm_head is None else self.lm_head(self.norm(x))

    def init_weights(self, seed):
        """Every parameter from one generator, in name order: the same weights on every rank and in every layout.
        Linear layers N(0, 0.02), the output projections scaled by 1/sqrt(2 * layers) (GPT-2's), norms 1."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                deep = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if deep else 0.02
                if not name.endswith("norm.weight"):  # the norms keep their ones, and draw nothing
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)
        return self


def hf_name(name):
    """Our parameter name as LlamaForCausalLM's state dict has it."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def encode(text):
    """Text as its UTF-8 bytes, the tokens: 256 of them, nothing to download or train, any text encodes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


SHAKESPEARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare", "input.txt")


def read_text(path=None):
    """(text, what it is). path None: data/shakespeare/input.txt (four plays, in this repository), or where that is
    not beside this file, Python's own help text (pydoc_data.topics, English prose in every Python)."""
    if path is None and not os.path.isfile(SHAKESPEARE):
        from pydoc_data.topics import topics
        text = "\n".join(topics[key] for key in sorted(topics))
        return text, f"Python's help text (pydoc_data: no data/shakespeare/input.txt here), {len(text):,} characters"
    path = path or SHAKESPEARE
    with open(path, encoding="utf-8") as f:  # a missing or binary file raises here: the script says it in one line
        text = f.read()
    return text, f"{os.path.basename(path)}, {len(text):,} characters"


def text_splits(text, seq_len, held_out=0.1):
    """(train, held out): the text's bytes in windows of seq_len + 1, one after another, sample i (window[:-1],
    window[1:]); the last `held_out` of the text held out. Both take a list of indices (GlobalOrderSampler's)."""
    def windows(tokens):
        count = (len(tokens) - 1) // seq_len
        return TensorDataset(*(tokens[i:i + count * seq_len].view(count, seq_len) for i in (0, 1)))

    tokens = encode(text)
    cut = int(len(tokens) * (1 - held_out))
    return windows(tokens[:cut]), windows(tokens[cut:])


@torch.no_grad()
def sample(model, prompt, new_tokens, temperature=0.8, seed=0):
    """Text generated by a whole (unsplit) decoder: the prompt, then new_tokens bytes drawn one at a time."""
    generator, device = torch.Generator().manual_seed(seed), model.lm_head.weight.device
    tokens = encode(prompt).to(device)
    for _ in range(new_tokens):
        logits = model(tokens[None, -model.config.max_seq_len:])[0, -1].double().cpu()
        token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        tokens = torch.cat([tokens, token.to(device)])
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
