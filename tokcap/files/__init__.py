"""The files shell: the only code that touches a store directory.

``rollout_files.RolloutFiles`` carries out the rules' effects; two writers stand on it side by side,
``store.TokenCaptureStore`` (a directory several processes share) and ``log_projection.Projection``
(a directory one process owns). Recovery, locks, durable steps, group commit and the entry caches are
theirs. It decides nothing: every rule is in ``tokcap.log``.
"""

__all__: list[str] = []
