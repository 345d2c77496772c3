"""`accum-finetune`: the fine-tuning job built on the `accum_callback` library (cli, data, models, finetune, pretrain,
study). Importing this package loads nothing heavy: the command line parses its arguments before torch loads."""
