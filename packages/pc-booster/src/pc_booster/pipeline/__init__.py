"""A ``transformers`` model as a sequence of pipeline layers, for the hybrid
plugin: the embedding, each transformer block, and the head, each taking
the previous one's output (token ids, then hidden states, then logits).

Any family whose config carries transformers' ``base_model_pp_plan`` is cut
from it, whatever its head (causal LM, masked LM, sequence or token
classification): each block gets the arguments the base model's own forward
gives it (masks of every kind, rotary embeddings), recorded once per shape
by running that forward with the blocks replaced; the first layer is that
forward up to the first block, the last the model's forward after the last
block. GPT-2 and BERT, which have no plan, are cut from pc's own lists:

Causal models get their causal mask from the attention itself under
``sdpa`` and FlashAttention (``is_causal`` when no mask is given); under
``eager`` attention, which applies only the mask it is given, every block
gets an explicit causal mask. BERT attends everywhere, as the whole model
does for unpadded batches. Padding masks are not carried through the
pipeline.
"""

from pc_booster.pipeline.cut import pipeline_layers
from pc_booster.pipeline.stages import SequenceShare, feed_inputs, router_recorder

__all__ = ["SequenceShare", "feed_inputs", "pipeline_layers", "router_recorder"]
