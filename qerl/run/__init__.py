"""The run on disk: what keeps a run's folder and every other output safe from kills, full disks and a second writer.

Owns the run folder as one object (`folder.RunFolder`: its lock, the start / --resume / --overwrite rules, its
checkpoints with their manifests, its metrics log, the cleanup of killed writes), and the pieces it is built from,
which other outputs use too: `lock` (an exclusive OS lock on a folder), `atomic` (a file or folder appears whole or
not at all), `manifest` (sizes and hashes, written last), `safestate` (a state as JSON + safetensors, nothing
executable), `checkpoints` (the checkpoints sub-folder), `metrics` (metrics.jsonl), `outdir` (--out checked up front).

May import: qerl.errors (and nothing else of qerl: every other part writes through this one).
"""
