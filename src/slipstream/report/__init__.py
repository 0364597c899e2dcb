"""Reading finished runs for people: `slipstream report` (one self-contained HTML page of one or
more runs, a tuning study or a ladder benchmark) and `slipstream compare` (two runs side by side
in the terminal)."""
