"""The shared harness (ranks, cases, launches) and the reference helpers every folder's cases
import."""
