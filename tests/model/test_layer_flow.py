"""The model's layer flow (each layer ending with the norm after it) against the flow before, on the torch paths:
logits and EAGLE3 aux streams bit for bit, every aux position (0: the embedding, 3: the final pre-norm stream)."""

import pytest
import torch

from tests.helpers.layer_flow_check import check_layer_flow, load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_flow_equals_before(tiny_ckpt, dtype):
    model = load_model(tiny_ckpt, "cpu", dtype, "torch")
    for aux in ((), (0, 1, 2, 3), (2,), (1, 3)):
        assert check_layer_flow(model, "cpu", aux_layer_ids=aux) == 0  # the torch MoE never fuses the norm
