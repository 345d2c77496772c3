"""Checks that change nothing: `check_accumulation()` (`accumulation`: is the accumulated gradient the large
batch's?), `check_batchnorm()` (`batchnorm`: how stale are the running statistics?) and the sandboxed replay of
micro-batches both use (`replay`)."""
