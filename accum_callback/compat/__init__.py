"""torch's and fastai's names outside their public APIs, fenced in two modules: `compat.torch` (private torch
attributes, version differences, FSDP2's internals) and `compat.fastai` (fastai's private loop names and loader
internals). Nothing else in the package reaches either library's private names (tests/test_package.py)."""
