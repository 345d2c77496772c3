"""Micro-batching (`MicroBatching(size)`, or `learn.accumulate(micro_bs=...)`): one module per concern.

- `pieces`: which rows each piece of a batch holds (`piece_bounds`, `halved`: the rules, once), slicing, joining,
  out-of-memory errors
- `state`: models that carry state between batches (`stateful_modules`, per-row `RowStates`, `copy_module`)
- `loader`: the training loader cut (`MicroBatches`) and the piece being run (`Piece`)
- `retry`: undoing a micro-batch (`Snapshot`)
- `inference`: inference batches cut under 'auto'
- `callback`: `MicroBatching`, which puts them together"""
from .pieces import is_out_of_memory, n_pieces, piece_bounds, halved, slice_batch, cat_outputs
from .state import copy_module, StatefulModelError, stateful_modules, RowStates
from .loader import Piece, MicroBatches
from .callback import MicroBatching, check_micro_bs, micro_batching, micro_size

__all__ = ['MicroBatching', 'check_micro_bs', 'micro_batching', 'micro_size', 'Piece', 'MicroBatches',
           'is_out_of_memory', 'n_pieces', 'piece_bounds', 'halved',
           'slice_batch', 'cat_outputs', 'copy_module', 'StatefulModelError', 'stateful_modules', 'RowStates']
