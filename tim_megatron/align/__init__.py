"""``tim align``: find where the rollout engine and the trainer part ways, layer by layer.

The same token sequences go through the vLLM engine and the Megatron trainer, each with the recipe's dtypes and
layout. Each side records, per decoder layer, the residual stream after attention and after the MLP/MoE block,
the router's logits, top-k experts and gating weights, then the final norm and the head's logprobs
(:mod:`~tim_megatron.align.capture`). :mod:`~tim_megatron.align.compare` measures the differences and names the
first layer and component above the tolerance; :mod:`~tim_megatron.align.report` writes ``align.json``, a text
table and a plot.
"""
