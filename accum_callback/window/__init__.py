"""The accumulation window: how big it is and when it closes (`schedule`, `plan`), its state and verdict
(`state`), one global order of samples over the ranks (`global_window`), its log (`log`), what is said at fit start
(`advice`) and `GradientAccumulation` (`accumulate`), the fastai callback that adapts the loop's events to it."""
