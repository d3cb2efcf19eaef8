"""tim-megatron: MoE RL with megatron-core trainers and vLLM rollouts, built around training-inference mismatch."""

__version__ = "0.1.0"
