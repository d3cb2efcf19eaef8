"""Train the experts' output biases: added out of place, and their gradients left out of the tensor-parallel sum.

megatron-core 0.16.1's ``MLP.forward``, for an expert (called with the routing probabilities as
``per_token_scale``) whose ``linear_fc2`` has a bias (``add_bias_linear``, gpt-oss), ends with
``output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)``: an in-place add on the output of the
linear layer's autograd function, which is a view that autograd forbids changing in place. Every forward with
gradients on raises ``RuntimeError: Output 0 of LinearWithGradAccumulationAndAsyncCommunicationBackward is a view
and is being modified inplace`` (with gradients off it runs). The patch runs the original forward without the
probabilities for such an expert and weights the result afterwards, ``(fc2(act(fc1(x))) + b2) * p``: the same
function (``fc2`` is linear, so ``fc2(act * p) + b2 * p`` is that), in the order HF transformers' gpt-oss computes
it (``(h @ down + bias) * routing_weight``). Experts without a bias, and dense MLPs, run the original unchanged.

Second, on the built model (:func:`unmark_sequence_parallel`): ``RowParallelLinear`` marks its bias
``sequence_parallel`` whenever the config has sequence parallelism, and ``finalize_model_grads`` then sums every
such gradient over the tensor-parallel group, as it must for weights applied to a rank's shard of the sequence.
An expert's ``linear_fc2`` runs on the tokens dispatched to it, gathered from the whole sequence: its bias gradient
is already whole, and the sum adds another rank's expert at the same local index (under expert parallelism) or the
same expert again (under expert tensor parallelism). Measured on the tiny gpt-oss at TP = 2 (experts on EP = 2):
the forward is exact, and without this the fc2 biases' gradients are off by their whole size (1.6e-3 against
1.6e-3), every other gradient within 7e-7. Unmarking them leaves them to the expert-data-parallel reduction that
every other expert weight gets. Applied by the trainer to a model with ``model.dims.linear_biases``.
"""

from __future__ import annotations

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-expert-bias-grad",
    reason="an expert's fc2 bias is added in place to an autograd view (output += output_bias * probs), a "
    "RuntimeError whenever gradients are on; and its gradient is summed over the tensor-parallel group as if it "
    "were sequence-parallel.",
    targets=(
        "megatron.core.transformer.mlp.MLP.forward",
        "megatron.core.tensor_parallel.layers.RowParallelLinear.bias.sequence_parallel (experts' linear_fc2)",
    ),
)


def needed() -> bool:
    return True  # on every device: the in-place add is in megatron-core's Python code


def apply() -> Handle:
    """Wrap ``MLP.forward`` (see the module docstring)."""
    check_version(SPEC)
    from megatron.core.transformer.mlp import MLP

    original = MLP.forward

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is None or getattr(self.linear_fc2, "bias", None) is None:
            return original(self, hidden_states, per_token_scale, **kwargs)
        output, bias = original(self, hidden_states, None, **kwargs)
        if bias is not None:  # skip_bias_add: the bias comes back beside the output
            output = output + bias
        return (output * per_token_scale.unsqueeze(-1)).to(output.dtype), None

    forward.__wrapped__ = original
    h = Handle(SPEC.name)
    set_attr(h, MLP, "forward", forward)
    return h


def expert_fc2_biases(gpt) -> list:
    """The ``linear_fc2`` biases of the model's routed experts."""
    return [
        p
        for name, p in gpt.named_parameters()
        if ".mlp.experts." in name and name.endswith("linear_fc2.bias")
    ]


def unmark_sequence_parallel(gpt) -> int:
    """Clear ``sequence_parallel`` on the experts' fc2 biases (see the module docstring); returns how many."""
    check_version(SPEC)
    biases = expert_fc2_biases(gpt)
    for p in biases:
        p.sequence_parallel = False
    return len(biases)
