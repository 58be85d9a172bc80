"""atopgpud_tw: a GPU statistics daemon for atop, on Twisted."""

__version__ = "0.1.0"
