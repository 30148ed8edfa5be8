import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
