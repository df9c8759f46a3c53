"""vLLM's console in a vime run: its warnings and errors, minus start-up notices that carry nothing.

vLLM logs at WARNING in a default run; a set of its warnings are fixed notices about the CPU
build or about settings vime makes on purpose, repeated by every process vLLM starts (and one
per weight reload). `KNOWN_NOTICES` lists them, each with why it is safe to drop; everything
else vLLM warns about reaches the console, and ERROR lines always do. `--verbose` (or a
`VLLM_LOGGING_LEVEL` / `VLLM_LOGGING_CONFIG_PATH` the user set) shows vLLM's own logging unfiltered.

The filter reaches vLLM's engine and worker processes through `VLLM_LOGGING_CONFIG_PATH`
(vLLM's own logging-config switch, inherited by the processes it spawns): `logging.json`
beside this module is vLLM's default logging config at WARNING with `KnownNotices` attached.
"""
import logging
import os
import warnings

LOGGING_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "logging.json")

# (start of the message, why dropping it loses nothing in a vime run)
KNOWN_NOTICES = (
    ("Triton is not installed", "the CPU build runs its torch kernels; nothing to install for vime"),
    ("Triton is installed, but doesn't include CPU backend", "same: vLLM falls back by itself"),
    ("Model Runner V2 requires Triton", "the V1 runner is the CPU build's runner"),
    ("Enforce eager set", "vime sets enforce_eager on CPU on purpose (no graphs to capture)"),
    ("Inductor compilation was disabled", "follows from enforce_eager"),
    ("max_num_scheduled_tokens is set to", "vLLM sizes its token budget for the draft slots itself"),
    ("Enabling num_speculative_tokens > 1 will run multiple times",
     "the reused MTP layer is how vime drafts k > 1; acceptance is measured and logged"),
    ("min_p and logit_bias parameters won't work with speculative decoding", "vime sends neither"),
    ("libtcmalloc is not found in LD_PRELOAD", "a speed hint for the CPU build; BENCHMARKS.md says how it ran"),
    ("libiomp is not found in LD_PRELOAD", "same"),
    ("Speculative decoding on CPU without Intel OpenMP", "same"),
    ("Kernel vllm.v1.sample.rejection_sampler.expand_kernel is already registered",
     "rollout/vllm/worker.py replaces that kernel on purpose (the CPU build's one is broken)"),
    ("RotaryEmbedding: Failed to load weights",
     "an in-place reload carries weights, not the rotary cache vLLM recomputes; the sync guard checks every weight"),
    ("Eagle3LlamaForCausalLM: Failed to load weights",
     "a reload of a reduced-vocabulary EAGLE-3 draft carries its trained weights, not its fixed d2t table, which "
     "vLLM keeps; the sync guard checks every weight"),
    ("Chat template warmup failed", "vime hands vLLM token ids (no tokenizer in the engine)"),
    ("Using None for EOS token id because tokenizer is not initialized",
     "vime sends the model's EOS ids as each request's stop ids"),
    ("Allowing insecure serialization using pickle",
     "vime sets it to ship its weight-reload functions to vLLM's workers, over vLLM's loopback sockets"),
)


class KnownNotices(logging.Filter):
    """Drops vLLM records below ERROR whose message starts with a `KNOWN_NOTICES` entry."""

    def filter(self, record):
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        return not any(message.startswith(start) for start, _ in KNOWN_NOTICES)


_REDUCE_OP_WARNING = "`torch.distributed.reduce_op` is deprecated"

# loggers that warn before vLLM has read its logging config (at `import vllm`)
_EARLY_LOGGERS = ("vllm.triton_utils.importing",)


def _user_chose_vllm_logging():
    """Whether vLLM's logging switches were set by the user. A process of a vime run (a Ray actor, a run a
    test or tool starts) inherits the ones `quiet_vllm_console` set, which point at this module's config:
    that process still needs its own early filters, which no environment variable carries."""
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path is not None:
        return os.path.abspath(path) != LOGGING_CONFIG
    return "VLLM_LOGGING_LEVEL" in os.environ


def quiet_vllm_console():
    """Set up this process (and, through the environment, the ones vLLM starts) for a quiet vLLM:
    nothing changes where the user chose vLLM's logging (VLLM_LOGGING_LEVEL/_CONFIG_PATH)."""
    if _user_chose_vllm_logging():
        return
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = LOGGING_CONFIG
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"  # vLLM's other level checks read this one
    for name in _EARLY_LOGGERS:
        logging.getLogger(name).addFilter(KnownNotices())
    # torch.distributed's deprecated alias, touched by vLLM's kernel dispatcher at import, here
    # and (through PYTHONWARNINGS) in the processes vLLM spawns
    warnings.filterwarnings("ignore", message=_REDUCE_OP_WARNING, category=FutureWarning)
    spawned = f"ignore:{_REDUCE_OP_WARNING}:FutureWarning"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), spawned)))
