"""Resume a fit where it stopped: `Checkpoint` (`checkpoint`: when, where, which file, which fit), the file format
(`format`: plain types, read without running code), the pieces of the fit's state (`fit_place`: the place in the fit;
`fit_state`: what training made), what another number of processes changes (`world_size`) and sharded models'
files (`sharded`, DCP)."""
