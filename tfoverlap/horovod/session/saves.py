"""Saves of a graph-mode program whose optimizer state decoupled reduction shards:
:func:`consolidate_optimizer_state`, and ``MonitoredTrainingSession`` checkpoints on rank 0
alone, made to wait for the state gathered on every rank."""
from __future__ import annotations

from tfoverlap.horovod.core.patching import patch, unpatched
from tfoverlap.horovod.session.pending import join_reductions
from tfoverlap.horovod.session.sharded_state import sharded_states
from tfoverlap.log import logger

__all__ = ["consolidate_optimizer_state", "install_session_saves"]


def _savable(session) -> bool:
    """Whether a checkpoint of ``session``'s graph can be written on this rank now."""
    states = sharded_states.get(session.graph)
    return not states or all(session.run([state.savable for state in states]))


def install_session_saves() -> None:
    """Makes ``MonitoredTrainingSession``'s saves on rank 0 alone work with a sharded state
    (once; idle for graphs without one): a ``CheckpointSaverHook`` save asks for a
    consolidation and is made after the next train run, whose background run consolidates
    on every rank; a session that closes after training consolidates before its hooks end,
    so the final save holds the last step's state."""
    from tensorflow.python.training import basic_session_run_hooks, monitored_session
    saver_hook = basic_session_run_hooks.CheckpointSaverHook
    patch(saver_hook, "_save", _postponing_saves)
    patch(saver_hook, "after_run", _saving_postponed_after_run)
    patch(saver_hook, "end", _saving_postponed_at_end)
    patch(monitored_session._MonitoredSession, "_close_internal",  # noqa: SLF001
          _consolidating_at_close)


def _request_consolidation(session) -> None:
    """Asks for the state to be gathered by the next background run, on every rank."""
    join_reductions()
    session.run([state.request for state in sharded_states[session.graph]])


def _save_postponed(hook, session):
    """The postponed save where the state is whole now (else None, asked for again)."""
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
    """Gathers the whole optimizer state of ``session``'s decoupled optimizers on every
    rank, kept until its next train run, so that a Saver on one rank writes it whole
    (collective: every rank calls it, after the same train runs). False where nothing is
    decoupled. A restored or broadcast state is held whole already."""
    states = sharded_states.get(session.graph, [])
    if states:
        session.run([state.consolidate for state in states])
    return bool(states)
