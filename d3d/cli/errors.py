"""`UserError`: a command's input was wrong; `d3d` prints its message on one line (no traceback) and exits 2."""


class UserError(Exception):
    """Bad input to a command (a missing file, a refused destination...): the message says what and where."""
