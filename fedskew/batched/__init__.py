"""The batched engine (`fedskew run --engine batched`, run-config key `engine`): one process runs the
ServerApp and every client of a round, training the sampled clients of the methods that opt in as
one stacked model.

- `stacked`: the maths, pure torch (stacked SGD, each client's own mini-batches, masking);
- `executor`: a round's train messages -> reply messages, with the methods' trainers;
- `grid`: a Flower `Grid` over in-process nodes that hands each round to the executor, and
  `run_batched`, the ServerApp's `main` on it.
"""
