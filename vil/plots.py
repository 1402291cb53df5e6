"""The benchmark tools' plots: matplotlib (the ``plots`` extra), drawing to files."""


def agg_pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display); one sentence with the install line when
    matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"Plots need matplotlib ({error}); install it with pip install 'vil[plots]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
