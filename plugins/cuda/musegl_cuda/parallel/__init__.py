"""Tensor parallelism of the torch decoder over the devices of one host (``--tensor-parallel-size``).

* :mod:`.shard`: which rows and columns of each weight a rank holds, and the two
  collectives the decoder needs (the all-reduce after a row-parallel product, the
  gather of vocabulary-parallel logits);
* :mod:`.channel`: the shared-memory ring that carries the engine's requests to the
  ranks (written once, read by every rank) and rank 0's answers back;
* :mod:`.rank`: the process of one rank (a sharded :class:`~musegl_cuda.executor.TorchExecutor`);
* :mod:`.executor`: :class:`.executor.TensorParallelExecutor`, the executor the engine sees.

See docs/scaling.md, "Tensor parallelism".
"""
