"""Both rollout backends implement every method of the written-down protocol (rollout/backend.py)."""
import inspect

from rollout.backend import EmbeddedBackend, RolloutBackend


def protocol_methods():
    return {name: inspect.signature(fn) for name, fn in vars(RolloutBackend).items()
            if callable(fn) and not name.startswith("_")}


def backend_classes():
    from rollout.vllm.backend import VLLMBackend  # imports no vLLM until one is built

    return [EmbeddedBackend, VLLMBackend]


def protocol_gaps(cls):
    """Protocol methods `cls` lacks or takes with other parameters."""
    gaps = []
    for name, sig in protocol_methods().items():
        impl = getattr(cls, name, None)
        if not callable(impl) or list(inspect.signature(impl).parameters) != list(sig.parameters):
            gaps.append(name)
    return gaps


def test_every_backend_has_every_protocol_method_with_its_parameters():
    assert {"generate", "load_weights", "weight_receiver", "fingerprint", "digests", "pause", "resume", "stats",
            "close"} <= set(protocol_methods())
    for cls in backend_classes():
        assert isinstance(cls.name, str) and protocol_gaps(cls) == [], (cls.__name__, protocol_gaps(cls))


def test_a_backend_missing_or_changing_a_method_is_caught():
    """Negative control: the check above sees a missing close() and a generate with other parameters."""
    class Partial(EmbeddedBackend):
        close = None

        def generate(self, samples):
            return samples

    assert sorted(protocol_gaps(Partial)) == ["close", "generate"]
