from dlite_trt.cli import main

main()
