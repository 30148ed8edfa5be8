"""The hooks that put Keras ``fit`` on the in-call backend: ``make_train_function`` (the
pipelined step and its drain), the data handler (the batch size), and the callbacks
(a decoupled state gathered where a save may follow: an epoch's end, a batch save)."""
from __future__ import annotations

import copy
import sys

from tfoverlap.horovod.adapters.keras_fit import (_deferrals, _drained, _fit_batch,
                                                  _optimizers, _pipelined)
from tfoverlap.horovod.core.patching import patch

__all__ = ["install"]


def install() -> None:
    """Makes ``make_train_function`` pipeline and drain the models compiled with a
    registered optimizer, and the callbacks gather a decoupled state where a save may follow."""
    import tensorflow as tf
    patch(tf.keras.Model, "make_train_function", _making_train_function)
    # Keras' fit makes its data handler (which knows the batch size) before it makes and
    # first calls the train function.
    patch(sys.modules[tf.keras.Model.__module__].data_adapter, "get_data_handler",
          _noting_batch_size)
    patch(tf.keras.callbacks.CallbackList, "on_epoch_end", _consolidating_at_epoch_end)
    patch(tf.keras.callbacks.CallbackList, "on_train_batch_end",
          _consolidating_before_batch_saves)


def _making_train_function(plain_make):
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        current = self.__dict__.get("train_step")    # a train_step set on the instance
        if hasattr(current, "tfoverlap_own"):           # ours, from an earlier compile
            del self.__dict__["train_step"]
            if current.tfoverlap_own is not None:
                self.__dict__["train_step"] = current.tfoverlap_own
            current = current.tfoverlap_own
        if getattr(self, "optimizer", None) not in _optimizers:
            return plain_make(self, force)
        _deferrals.pop(self, None)
        # Keras looks train_step up on the model when it traces the train function.
        self.__dict__["train_step"] = _pipelined(
            self, current or type(self).train_step.__get__(self), current)
        function = plain_make(self, force)
        self.train_function = _drained(self, function)
        return self.train_function
    return make_train_function


def _noting_batch_size(plain_handler):
    def get_data_handler(*args, **kwargs):
        handler = plain_handler(*args, **kwargs)
        adapter = getattr(handler, "_adapter", None)
        try:
            _fit_batch[0] = adapter.representative_batch_size()
        except Exception:  # noqa: BLE001 - an adapter that cannot tell: static shapes
            _fit_batch[0] = None
        return handler
    return get_data_handler


def _consolidating_at_epoch_end(plain_epoch_end):
    def on_epoch_end(self, epoch, logs=None):
        # Every rank ends the epoch alike: a checkpoint on rank 0 alone writes it whole.
        decoupled = getattr(_deferrals.get(getattr(self, "model", None)), "decoupled", None)
        if decoupled is not None and not decoupled.savable:
            decoupled.consolidate()
        return plain_epoch_end(self, epoch, logs)
    return on_epoch_end


def _consolidating_before_batch_saves(plain_batch_end):
    def on_train_batch_end(self, batch, logs=None):
        decoupled = getattr(_deferrals.get(getattr(self, "model", None)), "decoupled", None)
        if decoupled is not None and _batch_save_due(self, decoupled, batch):
            decoupled.consolidate()
        return plain_batch_end(self, batch, logs)
    return on_train_batch_end


def _saves_by_batch(callback) -> bool:
    """Whether Keras ``callback`` writes checkpoints every N batches (ModelCheckpoint,
    BackupAndRestore with an integer ``save_freq``)."""
    frequency = getattr(callback, "save_freq", None)
    return isinstance(frequency, int) and not isinstance(frequency, bool) and frequency > 0


def _saves_at(callback, batch: int) -> bool:
    """Whether ``callback`` (saving by batch) saves at the end of ``batch``: its own rule,
    tried on a copy (ModelCheckpoint, BackupAndRestore); a rule not known, at every one."""
    if hasattr(callback, "_should_save_on_batch"):
        return bool(copy.copy(callback)._should_save_on_batch(batch))  # noqa: SLF001
    count = getattr(callback, "_batches_count", None)
    if isinstance(count, int):          # BackupAndRestore counts the batch ends it saw
        return count + 1 >= callback.save_freq
    return True


def _batch_save_due(callback_list, decoupled, batch: int) -> bool:
    """Whether a callback of rank 0 saves at the end of ``batch`` while this rank holds only
    its shards. Collective: once per fit a flag from rank 0 (does one save by batch?), and
    where one does, one at each batch end (does one save now?)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    savers = [callback for callback in callback_list.callbacks if _saves_by_batch(callback)]
    known = callback_list.__dict__.get("_tfoverlap_batch_saves")
    if known is None:
        known = bool(int(hvd.broadcast(tf.constant(int(bool(savers))), 0,
                                       process_set=decoupled.process_set)))
        callback_list._tfoverlap_batch_saves = known  # noqa: SLF001 - this fit's answer
    if not known or decoupled.savable:
        return False
    due = any(_saves_at(callback, batch) for callback in savers)
    return bool(int(hvd.broadcast(tf.constant(int(due)), 0,
                                  process_set=decoupled.process_set)))
