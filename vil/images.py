"""Image files as the models see them, read one way wherever images come from (image folders, shards, the files
given to predict): training, evaluation and prediction then agree on every pixel."""

import warnings

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError


def read_image(source) -> Image.Image:
    """The image at ``source`` (a path or a binary file object) in RGB as a viewer shows it: turned as its EXIF
    orientation says (a phone's photos), and 16-bit grey levels scaled to 8 bits (a plain conversion clips every
    level above 255 to white). Floating-point images, and 32-bit integer ones beyond 16-bit levels, whose range
    nothing states, are refused in one sentence."""
    try:
        with warnings.catch_warnings():  # Pillow only warns up to twice its limit, in words that name no file
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(source)
    except UnidentifiedImageError:  # its words name a file object by its address in memory
        raise ValueError("cannot identify image file as any format Pillow reads") from None
    except Image.DecompressionBombWarning:
        raise ValueError(
            f"it has more than Pillow's {Image.MAX_IMAGE_PIXELS} pixels, the size of a possible decompression bomb; "
            "raise PIL.Image.MAX_IMAGE_PIXELS if it is a real image"
        ) from None
    with opened as image:
        if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:  # else exif_transpose would copy it
            image = ImageOps.exif_transpose(image)
        if image.mode == "F":
            raise ValueError(
                "it holds floating-point pixels (mode F), whose range is not known; save it as 8- or 16-bit"
            )
        if image.mode.startswith("I"):  # I;16, I;16B, and I (how older Pillow opens 16-bit PNGs): 16-bit levels
            levels = np.asarray(image, dtype=np.float64)
            if levels.size and (levels.min() < 0 or levels.max() > 65535):
                raise ValueError(
                    f"it holds 32-bit integer pixels (mode {image.mode}) outside 16-bit levels (up to "
                    f"{levels.max():.0f}), whose range is not known; save it as 8- or 16-bit"
                )
            image = Image.fromarray(np.rint(levels * (255 / 65535)).astype(np.uint8))
        if image.mode == "P" and "transparency" in image.info:  # Pillow asks for RGBA first, in a warning
            image = image.convert("RGBA")
        return image.convert("RGB")
