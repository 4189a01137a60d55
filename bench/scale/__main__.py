"""``python -m bench.scale``: the scale simulator's command line (:func:`bench.scale.simulator.main`)."""

from bench.scale.simulator import main

if __name__ == "__main__":
    raise SystemExit(main())
