"""Saves of a graph-mode program whose optimizer state is sharded (decoupled reduction):
:func:`consolidate_optimizer_state`, and ``MonitoredTrainingSession`` checkpoints on rank
0 alone, made to wait for the state gathered on every rank (:func:`install_session_saves`).
"""
from __future__ import annotations

from tfoverlap.horovod.core.patching import patch, unpatched
from tfoverlap.horovod.session.pending import join_reductions
from tfoverlap.horovod.session.sharded_state import sharded_states
from tfoverlap.log import logger

__all__ = ["consolidate_optimizer_state", "install_session_saves"]


def _savable(session) -> bool:
    """Whether a checkpoint of ``session``'s graph can be written on this rank now (run
    on this rank alone: no collective)."""
    states = sharded_states.get(session.graph)
    return not states or all(session.run([state.savable for state in states]))


def install_session_saves() -> None:
    """Makes the saves of ``MonitoredTrainingSession`` on rank 0 alone work with a sharded
    optimizer state (once per process; idle for graphs without one):

    - a ``CheckpointSaverHook`` save due after a train run (on a timer only that rank
      follows) asks for a consolidation and is made after the next train run, whose
      background run consolidates on every rank (the request rides on its first
      all-gather);
    - a session that closes after training, on every rank alike, consolidates before its
      hooks end, so the final save holds the state of the last step."""
    from tensorflow.python.training import basic_session_run_hooks, monitored_session
    saver_hook = basic_session_run_hooks.CheckpointSaverHook
    patch(saver_hook, "_save", _postponing_saves)
    patch(saver_hook, "after_run", _saving_postponed_after_run)
    patch(saver_hook, "end", _saving_postponed_at_end)
    patch(monitored_session._MonitoredSession, "_close_internal",  # noqa: SLF001
          _consolidating_at_close)


def _request_consolidation(session) -> None:
    """Asks for the state to be gathered: after the background run in flight, the next
    one reads the request, and every rank gathers the state there."""
    join_reductions()
    session.run([state.request for state in sharded_states[session.graph]])


def _save_postponed(hook, session):
    """The postponed save, where the state is whole now (None, and asked for again, where
    it is not); its step counts as the timer's last."""
    from tensorflow.python.training import basic_session_run_hooks

    join_reductions()                       # the background run consolidated
    if not _savable(session):
        _request_consolidation(session)
        return None
    hook._tfoverlap_postponed = False  # noqa: SLF001
    step = session.run(hook._global_step_tensor)  # noqa: SLF001
    hook._timer.update_last_triggered_step(step)  # noqa: SLF001
    plain_save = unpatched(basic_session_run_hooks.CheckpointSaverHook._save)  # noqa: SLF001
    return plain_save(hook, session, step)


def _postponing_saves(plain_save):
    def save(self, session, step):
        if _savable(session):
            return plain_save(self, session, step)
        _request_consolidation(session)
        self._tfoverlap_postponed = True  # noqa: SLF001
        logger.info("tfoverlap: decouple: the checkpoint due at step %d waits one step for "
                    "the sharded optimizer state to be gathered on every rank", step)
        return False
    return save


def _saving_postponed_after_run(plain_after_run):
    def after_run(self, run_context, run_values):
        if getattr(self, "_tfoverlap_postponed", False):
            saved = _save_postponed(self, run_context.session)
            if saved is not None:
                if saved:
                    run_context.request_stop()
                return None
        return plain_after_run(self, run_context, run_values)
    return after_run


def _saving_postponed_at_end(plain_end):
    def end(self, session):
        # A save postponed at the last step: the close has gathered the state.
        if getattr(self, "_tfoverlap_postponed", False) and _save_postponed(
                self, session) is None:
            logger.warning("tfoverlap: decouple: the final checkpoint was not written: the "
                           "optimizer state is sharded and was not gathered at the close")
        return plain_end(self, session)
    return end


def _consolidating_at_close(plain_close):
    def close_internal(self, exception_type=None):
        session = getattr(self._coordinated_creator, "tf_sess", None)  # noqa: SLF001
        if exception_type is None and session is not None and not _savable(session):
            consolidate_optimizer_state(session)
        return plain_close(self, exception_type)
    return close_internal


def consolidate_optimizer_state(session) -> bool:
    """Gathers the whole optimizer state of every decoupled optimizer of ``session``'s
    graph on every rank (collective: every rank calls it, after the same train runs), so
    that a Saver run on one rank (rank 0, as Horovod programs do) writes it whole. Each
    rank keeps the whole state until its next train run. Returns False where nothing is
    decoupled (nothing to do). A save needs it only after a train run: a checkpoint
    restored, or broadcast from rank 0, is held whole already."""
    states = sharded_states.get(session.graph, [])
    if states:
        session.run([state.consolidate for state in states])
    return bool(states)
