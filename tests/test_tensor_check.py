"""The tensors-against-config comparison names each sort of disagreement with the key behind it."""
import torch
from safetensors.torch import save_file

from vime.models.tensor_check import Expected, safetensors_shapes, tensor_mismatch

EXPECTED = {"a.weight": Expected((4, 8), "hidden_size"), "b.weight": Expected((8,), "intermediate_size")}


def test_an_exact_match_has_no_mismatch():
    assert tensor_mismatch(EXPECTED, {"a.weight": (4, 8), "b.weight": (8,)}) is None


def test_missing_extra_and_misshaped_tensors_are_each_named_with_their_config_key():
    line = tensor_mismatch(EXPECTED, {"a.weight": (4, 9), "c.weight": (1,)}, explain_extra=lambda n: "n_extra")
    assert "1 tensor(s) the config implies are missing (first: b.weight, implied by intermediate_size)" in line
    assert "1 tensor(s) the config does not describe (first: c.weight; check n_extra)" in line
    assert "a.weight has shape [4, 9] but the config (hidden_size) gives [4, 8]" in line
    assert "\n" not in line


def test_shapes_come_from_the_safetensors_header(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(8)}, str(path))
    assert safetensors_shapes(path) == {"a.weight": (4, 8), "b.weight": (8,)}
