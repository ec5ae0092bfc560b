"""Transfer stages (fine-tuning, Detectron2 detection) reading RUN_DIR/backbone.pth: not built yet."""
