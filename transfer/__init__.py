"""Transfer stages reading RUN_DIR/backbone.pth: fine-tuning and detection (`python -m transfer --help`)."""
