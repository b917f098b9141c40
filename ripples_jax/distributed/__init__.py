"""What every multi-process executor shares, below them all: agreeing on where to resume."""
