"""Pure tensor maths, no Composer."""
