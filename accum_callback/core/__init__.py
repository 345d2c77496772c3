"""What every feature stands on: argument checks (`args`), durable file writes (`files`), counting a loss's items
(`losses`), the ranks (`distributed`: DDP and FSDP2 primitives), the training loader as the package reads it
(`loaders`) and the protocols callbacks meet by (`protocols`: the window's owner, running-statistics policies, the fit
guard, stop signals)."""
