"""What the Horovod test jobs keep of tfoverlap's log (imported from the job's directory)."""
import logging


class Warnings(logging.Handler):
    """Keeps the messages of the warnings logged."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
