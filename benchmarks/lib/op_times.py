"""Where an in-process engine's step time goes, for throughput.py --op-times.

Two hook points, neither of which replaces any function: the engine's step observers
(pagedlm/metrics/stats.py: the tracer's hook, which hands every step its StepTimes: schedule,
prepare, forward, sample, output) and PyTorch's forward hooks on the model's modules, which time
each call of the linear layers (binned by the rows multiplied, with the GFLOP/s that implies),
the LM head, the attention layers (split by whether the step had prefill rows) and the fused
decode stack (which runs a pure decode step's decoder layers in one native call, so no layer
hook fires inside it; PAGEDLM_DISABLE_FUSED_DECODE=1 runs them layer by layer).

Only a model in this process can be hooked: the uni executor's worker (not -tp / -pp workers).
"""
from __future__ import annotations

import time

from torch import nn

from pagedlm.attention.layer import Attention
from pagedlm.metrics.stats import FinishedStep, StepObserver
from pagedlm.model_executor.layers.linear import LinearBase
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead

BINS = ((8, "1-8"), (64, "9-64"), (128, "65-128"), (1 << 62, ">128"))
PHASES = ("schedule", "prepare", "forward", "sample", "output")


def rows_bin(rows: int) -> str:
    return next(name for top, name in BINS if rows <= top)


class OpTimes(StepObserver):
    """Add it to an engine's observers after `attach`ing it to that engine's model; `detach`
    removes the module hooks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._handles: list = []
        self._started: dict[int, float] = {}  # id(module) -> perf_counter at its pre-hook

    def _add(self, key: str, dt: float, flops: float = 0.0) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt
        self.calls[key] = self.calls.get(key, 0) + 1
        self.flops[key] = self.flops.get(key, 0.0) + flops

    # -- the engine's hook ----------------------------------------------------------------------
    def step_finished(self, step: FinishedStep) -> None:
        self.steps += 1
        for phase in PHASES:
            self.phases[phase] += getattr(step.times, phase)

    # -- the model's hooks ----------------------------------------------------------------------
    def attach(self, model: nn.Module) -> "OpTimes":
        for module in model.modules():
            if isinstance(module, (LinearBase, ParallelLMHead)):
                self._timed(module, self._matmul_label)
            elif isinstance(module, Attention):
                self._timed(module, self._attention_label)
            fused = getattr(module, "fused_decode", None)
            if fused is not None:
                self._time_fused(module, fused)
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _timed(self, module: nn.Module, label) -> None:
        def before(m, args, kwargs):
            self._started[id(m)] = time.perf_counter()

        def after(m, args, kwargs, out):
            dt = time.perf_counter() - self._started.pop(id(m))
            key, flops = label(m, args, kwargs, out)
            self._add(key, dt, flops)

        self._handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                          module.register_forward_hook(after, with_kwargs=True)]

    @staticmethod
    def _matmul_label(m, args, kwargs, out) -> tuple[str, float]:
        x = args[0] if args else next(iter(kwargs.values()))
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        flops = 2.0 * rows * x.shape[-1] * out.shape[-1]
        if isinstance(m, ParallelLMHead):
            return f"LM head, {rows_bin(rows)} rows", flops
        method = getattr(m, "linear_method", None)
        kind = ("linear" if type(method) is UnquantizedLinearMethod
                else f"linear {type(method).__name__}")
        return f"{kind}, {rows_bin(rows)} rows", flops

    @staticmethod
    def _attention_label(m, args, kwargs, out) -> tuple[str, float]:
        meta = args[4] if len(args) > 4 else kwargs.get("attn_metadata")
        prefills = bool(getattr(meta, "prefills", None))
        return ("attention, steps with prefill rows" if prefills
                else "attention, decode-only steps"), 0.0

    def _time_fused(self, model: nn.Module, fused) -> None:
        """The span from the embedding's output to the final norm's input, on steps where the
        fused stack ran (its step counter moved): the decoder layers, in one native call."""
        embed, norm = getattr(model, "embed_tokens", None), getattr(model, "norm", None)
        if embed is None or norm is None:
            return
        state = {"steps": 0, "t": 0.0}

        def stack_steps() -> int:
            return fused.stack.steps if fused.stack is not None else 0

        def model_begins(m, args):
            state["steps"] = stack_steps()

        def embedded(m, args, out):
            state["t"] = time.perf_counter()

        def norm_begins(m, args):
            if stack_steps() != state["steps"]:
                self._add("fused decode stack", time.perf_counter() - state["t"])

        self._handles += [model.register_forward_pre_hook(model_begins),
                          embed.register_forward_hook(embedded),
                          norm.register_forward_pre_hook(norm_begins)]

    # -- the report -----------------------------------------------------------------------------
    def report(self, elapsed: float) -> None:
        total = sum(self.phases.values())
        print(f"step phases over {self.steps} steps ({total:.1f} s of {elapsed:.1f} s): "
              + ", ".join(f"{p} {t:.2f} s" for p, t in self.phases.items()))
        print(f"op times (within forward: {self.phases['forward']:.2f} s; the fused decode "
              "stack's layers are not split up, PAGEDLM_DISABLE_FUSED_DECODE=1 runs them layer "
              "by layer):")
        for key in sorted(self.seconds):
            rate = (f", {self.flops[key] / self.seconds[key] / 1e9:.0f} GFLOP/s"
                    if self.flops[key] else "")
            print(f"  {key:36s} {self.seconds[key]:8.2f} s  {self.calls[key]:7d} calls{rate}")
        rest = self.phases["forward"] - sum(self.seconds.values())
        print(f"  {'rest of forward (norms, rotary, ...)':36s} {rest:8.2f} s")

    def to_json(self) -> dict:
        return {"phases_s": self.phases, "steps": self.steps,
                "ops": {k: {"seconds": self.seconds[k], "calls": self.calls[k],
                            "flops": self.flops[k]} for k in sorted(self.seconds)}}


def linear_weight_bytes(llm) -> int:
    """Bytes of the weights every decode step reads: the linear layers and the LM head (of a
    model in this process)."""
    model = llm.llm_engine.executor.worker.model
    total = 0
    for m in model.modules():
        if not isinstance(getattr(m, "linear_method", None), LinearMethodBase):
            continue
        if hasattr(m, "qweight_data"):
            total += m.qweight_data.numel() * m.qweight_data.element_size()
            if m.qscale is not None:
                total += m.qscale.numel() * m.qscale.element_size()
        elif hasattr(m, "quant_shards"):  # GGUFShardedLinearMethod: a block tensor a shard
            total += sum(blocks.numel() for _, _, blocks in m.quant_shards)
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total
