"""The ``tfoverlap`` command (placeholder until the CLI issue lands)."""
def main(argv=None) -> int:
    raise SystemExit("the tfoverlap command is not implemented yet")
