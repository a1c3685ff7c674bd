"""Tensor and sequence parallelism with policies for Hugging Face models.

Status: skeleton. Nothing is exported yet; issue 9: parallel layers and
`shard_model` land here.
"""

__all__: list[str] = []
