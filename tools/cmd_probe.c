int cmd_probe(int argc, char **argv){(void)argc;(void)argv;return 1;} int cmd_probe_child(int argc, char **argv){(void)argc;(void)argv;return 1;}
